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

`check_outputs` is the one entry every command goes through: besides the checks above it
refuses, naming both, an output that resolves (through links and relative paths) to one of
the command's inputs, and an existing file of another kind than the output writes (a table
over a checkpoint, statistics into a data or model file), recognised by its content
(`file_kind`), whatever it is called::

    -o traj.extxyz: is the input -s traj.extxyz; give another file name
    training.stat_file data.h5: data.h5 is a data file (deepmd/hdf5), not a statistics file
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass

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


# ----------------------------------------------------------------------------- one rule


@dataclass(frozen=True)
class Output:
    """A place a command writes: ``what`` names it as the user gave it (``"-o"``,
    ``"training.stat_file"``); ``kind`` is what it holds (a ``KIND_*``), and an existing
    file of another known kind is never written over; ``directory``: files are written in it
    (``create``: made once checked); a file's missing parent directories are made with
    ``create``; ``reused``: an existing file is read, not replaced (a statistics cache), so
    only its kind is checked."""

    what: str
    path: str
    kind: str | None = None
    directory: bool = False
    create: bool = False
    reused: bool = False


def check_outputs(outputs: Sequence[Output], inputs: Sequence[tuple[str, str]]) -> None:
    """Every check of the module docstring, before any work: ``inputs`` are ``(what,
    path)`` pairs (``("-s", "traj.extxyz")``); a path that does not exist is skipped."""
    sources = [(what, path, _real(_file_part(path))) for what, path in inputs if path]
    for out in outputs:
        real = _real(out.path)
        for what, path, source in sources:
            if real == source:
                same = "" if os.path.normpath(path) == os.path.normpath(out.path) else (
                    f" (both resolve to {source})"
                )  # fmt: skip
                raise MDTrainError(
                    f"{out.what} {out.path}: is the input {what} {path}{same}; give another "
                    f"{'directory' if out.directory else 'file name'}"
                )
        if out.directory:
            check_output_dir(out.path, out.what, create=out.create)
            continue
        found = file_kind(out.path)
        if found is not None and found != out.kind:
            wanted = f"not {out.kind}" if out.kind else "not an output of this command"
            raise MDTrainError(
                f"{out.what} {out.path}: the file is {found}, {wanted}; it is left as it is "
                "(give another file name)"
            )
        if out.reused and found is not None:
            continue
        check_output_file(out.path, out.what, create_parents=out.create)


def _file_part(path: str) -> str:
    """``file.h5`` of a ``file.h5#/group`` input (an HDF5 system), else ``path``."""
    head, sep, _ = os.fspath(path).partition("#")
    return head if sep and not os.path.exists(path) else path


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


# ----------------------------------------------------------------------------- file kinds

KIND_CHECKPOINT = "a checkpoint (PyTorch file)"
KIND_FROZEN = "a frozen (TorchScript) model"
KIND_EXPORTED = "an exported (torch.export .pt2) model"
KIND_DP = "a DeePMD-kit model (.dp)"
KIND_DATA = "a data file (deepmd/hdf5)"
KIND_STAT = "a statistics file (training.stat_file)"
KIND_HDF5 = "an HDF5 file"
KIND_NEIGHBOR_STAT = "a neighbour-statistics file"
KIND_INPUT = "a training input (input.json, out.json)"
KIND_JSON = "a JSON file"
KIND_MODEL_DEVI = "a model-deviation table"
KIND_LCURVE = "a learning curve (lcurve.out)"
KIND_TRAJECTORY = "a trajectory"
KIND_PNG = "a PNG image"
KIND_SYSTEM = "a deepmd system (folder)"

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: The root attribute every statistics file mdtrain writes has (``model.stat_file.DATA_ATTR``).
STAT_FILE_ATTR = "mdtrain_training_data"
_STAT_NAME = re.compile(r"([ra]_\d+|bias_atom_energy|std_atom_energy)")
_MAX_JSON = 16 << 20  # a JSON file larger than this is not read to be told apart


def file_kind(path: str | os.PathLike) -> str | None:
    """What an existing file holds, told by its content (``KIND_*``); None for a path that
    does not exist, an empty file, or content of no kind an mdtrain command reads or writes."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return KIND_SYSTEM if os.path.isfile(os.path.join(path, "type.raw")) else None
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return None
    if head.startswith(_HDF5_SIGNATURE):
        return _hdf5_kind(path)
    if head.startswith(b"PK\x03\x04"):
        return _zip_kind(path)
    if head.startswith(b"\x89PNG"):
        return KIND_PNG
    return _text_kind(path, head)


def _zip_kind(path: str) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return None
    if any(n.endswith("/archive_format") for n in names):
        return KIND_EXPORTED
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return KIND_FROZEN
    if any(n.endswith("/data.pkl") for n in names):
        return KIND_CHECKPOINT
    return None


def _hdf5_kind(path: str) -> str:
    import h5py  # only for an HDF5 file: neighbor-stat starts without it

    names: list[str] = []
    try:
        with h5py.File(path, "r") as f:
            if "json" in f.attrs:
                return KIND_DP
            if STAT_FILE_ATTR in f.attrs:
                return KIND_STAT
            f.visititems(
                lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None
            )
    except OSError:
        return KIND_HDF5
    base = [name.rsplit("/", 1)[-1] for name in names]
    if any(b == "type.raw" for b in base):
        return KIND_DATA
    if all(_STAT_NAME.fullmatch(b) for b in base):
        return KIND_STAT  # an empty HDF5 file too
    return KIND_HDF5


def _text_kind(path: str, head: bytes) -> str | None:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines = text.lstrip().splitlines()
    if not lines:
        return None
    first = lines[0]
    if first.startswith("ITEM: TIMESTEP"):
        return KIND_TRAJECTORY
    if (
        first.strip().isdigit()
        and len(lines) > 1
        and ("Lattice=" in lines[1] or "Properties=" in lines[1] or len(lines) > 2)
    ):
        return KIND_TRAJECTORY  # (extended) XYZ: an atom count, a comment, atoms
    if first.startswith("#"):
        if any("max_devi_f" in line for line in lines[:2]):
            return KIND_MODEL_DEVI
        if "rmse" in first:
            return KIND_LCURVE
        return None
    if first.startswith("{"):
        return _json_kind(path)
    return None


def _json_kind(path: str) -> str | None:
    try:
        if os.path.getsize(path) > _MAX_JSON:
            return KIND_JSON
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(content, dict):
        return KIND_JSON
    if "max_nbor_size" in content:
        return KIND_NEIGHBOR_STAT
    if "model" in content and "training" in content:
        return KIND_INPUT
    return KIND_JSON
