"""Where outputs go, checked before any work starts.

A command that would compute for minutes (or a training for hours) and then fail to write its
result checks the places it will write first: a file where a directory must go (or the
reverse), a directory it cannot create files in, or a disk without room. Each problem is one
`MDTrainError` line naming the path as the user gave it, e.g.::

    -o run1: a file is in the way (run1 is a file, not a directory)
    --json out/res.json: cannot create files in out (Permission denied)
    -o model.pth: no space left on the disk of . (12 KiB free)

Writability is tested by creating and removing a probe file, so it holds for root, ACLs,
read-only mounts and quotas alike; free space is read by `free_bytes` (tests replace it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile

from mdtrain.errors import MDTrainError

#: Fewer free bytes than this where an output goes counts as a full disk.
MIN_FREE_BYTES = 1 << 20


def free_bytes(directory: str) -> int:
    """Bytes free for this user on the file system holding ``directory``."""
    return shutil.disk_usage(directory).free


def check_output_dir(path: str | os.PathLike, what: str, create: bool = False) -> None:
    """``path`` can be (or already is) a directory this process writes files in; with
    ``create`` it is made (with its parents) once checked."""
    path = os.fspath(path) or "."
    label = f"{what} {path}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise MDTrainError(f"{label}: a file is in the way ({path} is a file, not a directory)")
    base = _existing_ancestor(path, label)
    if create and not os.path.isdir(path):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise MDTrainError(f"{label}: cannot create it ({_reason(exc)})") from None
        base = path
    _probe(base, label)


def check_output_file(path: str | os.PathLike, what: str, create_parents: bool = False) -> None:
    """``path`` can be written as a file: not a directory, in a directory that exists (or,
    with ``create_parents``, can be made) and takes new files, on a disk with room. An
    existing file is left alone (it is replaced only when the work is done)."""
    path = os.fspath(path)
    label = f"{what} {path}"
    if not path or path.endswith(os.sep):
        raise MDTrainError(f"{label}: names a directory, a file name is needed")
    if os.path.isdir(path):
        raise MDTrainError(f"{label}: is a directory, a file name is needed")
    parent = os.path.dirname(path) or "."
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise MDTrainError(f"{label}: a file is in the way ({parent} is a file, not a directory)")
    base = _existing_ancestor(parent, label)
    if base != parent and not create_parents:
        raise MDTrainError(f"{label}: directory {parent} does not exist")
    _probe(base, label)


def _existing_ancestor(path: str, label: str) -> str:
    """The nearest existing directory at or above ``path``; a file on the way is an error."""
    current = path
    while not os.path.exists(current):
        parent = os.path.dirname(os.path.normpath(current))
        if parent in ("", current):
            return "."
        current = parent
    if not os.path.isdir(current):
        raise MDTrainError(f"{label}: a file is in the way ({current} is a file, not a directory)")
    return current


def _probe(directory: str, label: str) -> None:
    """Create and remove a small file in ``directory``, then check its free space."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".mdtrain-probe-", dir=directory)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise MDTrainError(f"{label}: no space left on the disk of {directory}") from None
        raise MDTrainError(
            f"{label}: cannot create files in {directory} ({_reason(exc)})"
        ) from None
    failure = None
    try:
        os.write(fd, b"\0")
    except OSError as exc:
        failure = exc
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    if failure is not None:
        raise MDTrainError(f"{label}: cannot write files in {directory} ({_reason(failure)})")
    try:
        free = free_bytes(directory)
    except OSError:  # no figure (some network file systems): the probe is all we know
        return
    if free < MIN_FREE_BYTES:
        raise MDTrainError(
            f"{label}: no space left on the disk of {directory} ({free // 1024} KiB free)"
        )


def _reason(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device"
    return exc.strerror or str(exc)
