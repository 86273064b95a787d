"""Expand the ``systems`` entries of input.json into individual system paths."""

from __future__ import annotations

import contextlib
import os

from mdtrain.data.hdf5 import find_h5_systems, is_hdf5, join_h5_path, split_h5_path
from mdtrain.data.lmdb_store import is_lmdb, lmdb_systems
from mdtrain.data.npy import Listing, folder_listing
from mdtrain.errors import MDTrainError


def expand_systems(
    entries: str | list[str], base_dir: str = ".", listings: dict[str, Listing] | None = None
) -> list[str]:
    """Every system named by ``entries`` (relative paths against ``base_dir``).

    - a directory: itself and every directory below it that holds ``type.raw``;
    - ``file.h5``: every group (the root included) that holds ``type.raw``;
    - ``file.h5#/group``: the group if it holds ``type.raw``, else the systems below it;
    - an LMDB directory (DeePMD-kit's layout): its groups of frames, ``dir#NAME``
      (`mdtrain.data.lmdb_store`).

    Each entry's systems are sorted; entries keep their order (so that a per-system list
    such as ``sys_probs`` still lines up with an explicit list); duplicates are dropped.
    Paths are absolute. ``listings``, when given, receives the entries of each system folder
    found by walking a directory, for `open_all` to open it without listing it again (a
    system call per folder less, for thousands of small systems).
    """
    if isinstance(entries, (str, os.PathLike)):
        entries = [entries]
    if not entries:
        raise MDTrainError("systems: the list of systems is empty")
    result: list[str] = []
    seen: set[str] = set()
    for entry in entries:
        for path in _expand_one(str(entry), base_dir, listings):
            if path not in seen:
                seen.add(path)
                result.append(path)
    return result


def _expand_one(entry: str, base_dir: str, listings: dict[str, Listing] | None) -> list[str]:
    file, sep, _ = entry.partition("#")
    file = os.path.abspath(os.path.join(base_dir, os.path.expanduser(file)))
    if is_lmdb(file):  # DeePMD-kit's LMDB: its groups of frames with the same atoms
        return lmdb_systems(file + entry[len(entry.partition("#")[0]) :])
    if sep:
        _, group = split_h5_path(entry)
        if not os.path.isfile(file):
            raise MDTrainError(f"system {entry}: HDF5 file {file} does not exist")
        if not is_hdf5(file):
            raise MDTrainError(f"system {entry}: {file} is not an HDF5 file")
        groups = find_h5_systems(file, group)
        if not groups:
            raise MDTrainError(f"system {entry}: no group holding type.raw at or below {group}")
        return [join_h5_path(file, g) for g in groups]
    if os.path.isdir(file):
        found = _walk_dirs(file, listings)
        if not found:
            raise MDTrainError(f"system {entry}: no directory holding type.raw under {file}")
        return found
    if os.path.isfile(file):
        if not is_hdf5(file):
            raise MDTrainError(f"system {entry}: {file} is neither a directory nor an HDF5 file")
        groups = find_h5_systems(file)
        if not groups:
            raise MDTrainError(f"system {entry}: no group holding type.raw in {file}")
        return [join_h5_path(file, g) for g in groups]
    raise MDTrainError(f"system {entry} does not exist ({file})")


def _walk_dirs(top: str, listings: dict[str, Listing] | None = None) -> list[str]:
    """Directories at or under ``top`` holding ``type.raw``; symlinks followed once.

    ``os.walk``'s order (top down, each folder's entries as listed), without its
    ``realpath`` of every folder (a system call per path component, for thousands of
    systems): a folder reached by a name that is not a link is its parent's real path
    and that name. ``listings``: see `expand_systems`."""
    found: list[str] = []
    visited: set[str] = set()
    stack = [(top, os.path.realpath(top))]
    while stack:
        root, real = stack.pop()
        if real in visited:
            continue
        visited.add(real)
        try:
            entries = list(os.scandir(root))
        except OSError:  # as os.walk: a folder that cannot be listed is passed over
            continue
        below = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if not is_dir:
                if entry.name == "type.raw":
                    found.append(os.path.normpath(root))
                    if listings is not None:
                        with contextlib.suppress(OSError):  # the store lists it itself
                            listings[found[-1]] = folder_listing(entries)
            elif not entry.name.startswith("set."):  # set.* folders never hold systems
                child = os.path.join(real, entry.name)
                if entry.is_symlink():
                    child = os.path.realpath(entry.path)
                below.append((entry.path, child))
        stack.extend(reversed(below))
    return sorted(found)
