"""Pack deepmd systems (folders or HDF5 groups) into one deepmd/hdf5 file, one group per
system, streamed (for ``mdtrain convert --pack``).

Unlike conversion, packing changes nothing in the data: every array of every set (labels,
and files mdtrain does not read such as ``fparam.npy``) keeps its dtype, shape and values,
and atoms keep their file order. Frames are copied a bounded number of bytes at a time, so
data sets larger than memory pack in memory of a few tens of megabytes. Datasets are
chunked along the frame axis (a chunk is what HDF5 reads and decompresses as one piece) and
optionally compressed (``lzf`` or ``gzip``, with the byte-shuffle filter, which groups the
bytes of the floats by significance).

Group names: a system that is itself an entry is named after its folder (``data_0``), a
system found under an entry folder by the entry's name and its path below it
(``water/data_0``), a group of an HDF5 input by its own path. Training lists the groups of a
file in name order, so the names must sort in the order the systems are given: then a
``systems`` entry naming the packed file gives the systems in the order the folders gave them
(per-system lists such as ``sys_probs`` stay valid).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np

from mdtrain.data.expand import expand_systems
from mdtrain.data.hdf5 import split_h5_path
from mdtrain.data.mixed import MixedSystem
from mdtrain.data.stores import open_store
from mdtrain.data.system import MixedTypeFound, System
from mdtrain.errors import MDTrainError
from mdtrain.progress import progress

COMPRESSIONS = ("none", "lzf", "gzip")
# frames per chunk: about this many bytes per array. mdtrain reads HDF5 without a chunk
# cache (hdf5.py), so a frame read from a compressed file decompresses its whole chunk:
# 16 KiB chunks read a random frame 3-4 times faster than 64 KiB ones, for 1-4 % more bytes
CHUNK_BYTES = {"none": 64 << 10, "lzf": 16 << 10, "gzip": 16 << 10}
DEFAULT_BUFFER_BYTES = 16 << 20  # frames copied at a time: about this many bytes per array


@dataclass(frozen=True)
class PackedSystem:
    """One system written: where it came from, its group, its frames."""

    source: str
    group: str
    nframes: int


@dataclass(frozen=True)
class _Piece:
    """Rows ``start .. stop`` of one source set, global frames ``first ..``."""

    set_name: str
    start: int
    stop: int
    first: int


def group_names(entries: list[str]) -> list[tuple[str, str]]:
    """``(system path, group name)`` for every system the entries name, in the given order."""
    pairs: list[tuple[str, str]] = []
    for entry in entries:
        for path in expand_systems([entry]):
            pairs.append((path, _group_name(entry, path)))
    seen: dict[str, str] = {}
    for path, name in pairs:
        if name in seen:
            raise MDTrainError(
                f"--pack: {seen[name]} and {path} would both become group /{name}; pack them "
                "into separate files or give their parent folder"
            )
        seen[name] = path
    names = [name for _, name in pairs]
    if names != sorted(names):
        first = next(k for k in range(len(names) - 1) if names[k] > names[k + 1])
        raise MDTrainError(
            f"--pack: group /{names[first + 1]} would be read back before /{names[first]} "
            "(the groups of a file are listed by name): give the systems in name order"
        )
    return pairs


def _group_name(entry: str, path: str) -> str:
    if "#" in path:
        _, group = split_h5_path(path)
        if group != "/":
            return group.strip("/")
        return os.path.splitext(os.path.basename(path.partition("#")[0]))[0]
    top = os.path.abspath(os.path.expanduser(entry))
    base = os.path.basename(os.path.normpath(top))
    if os.path.normpath(path) == os.path.normpath(top):
        return base
    return f"{base}/{os.path.relpath(path, top)}".replace(os.sep, "/")


def pack(
    entries: list[str],
    output: str,
    compression: str = "none",
    set_size: int | None = None,
    chunk_bytes: int | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
) -> list[PackedSystem]:
    """Write the systems named by ``entries`` to the new HDF5 file ``output``.

    ``set_size`` None keeps each system's ``set.*`` as they are; a number re-cuts the frames
    into sets of that many. ``chunk_bytes`` defaults to ``CHUNK_BYTES`` of the compression.
    The file appears under its name only when complete.
    """
    import h5py

    if compression not in COMPRESSIONS:
        raise MDTrainError(f"--compression {compression}: use one of {', '.join(COMPRESSIONS)}")
    chunk_bytes = chunk_bytes or CHUNK_BYTES[compression]
    if os.path.exists(output):
        raise MDTrainError(f"-o {output}: already exists; remove it or choose another name")
    pairs = group_names(entries)
    systems = [(_open(path), name) for path, name in pairs]
    if set_size is not None:
        for system, _ in systems:
            _check_resplit(system)
    total = sum(system.nframes for system, _ in systems)
    partial = f"{output}.partial-{os.getpid()}"
    done: list[PackedSystem] = []
    try:
        with h5py.File(partial, "w") as handle:
            ticks = progress(_copy_all(handle, systems, compression, set_size, chunk_bytes,
                                       buffer_bytes, done), total, "packing")  # fmt: skip
            for _ in ticks:
                pass
        os.replace(partial, output)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
    return done


def _open(path: str) -> System | MixedSystem:
    """The system at ``path`` as stored (a mixed-type one is copied whole, not split)."""
    store = open_store(path)
    try:
        return System(store)
    except MixedTypeFound:
        return MixedSystem(store)


def _copy_all(handle, systems, compression, set_size, chunk_bytes, buffer_bytes, done):
    """Copy every system; yields once per frame copied (for the progress display)."""
    for system, name in systems:
        yield from _copy_system(
            handle, system, name, compression, set_size, chunk_bytes, buffer_bytes
        )
        done.append(PackedSystem(system.path, "/" + name, system.nframes))


def _copy_system(
    handle, system: System | MixedSystem, name, compression, set_size, chunk_bytes, buffer_bytes
):
    store = system.store
    group = handle.create_group(name)
    group.create_dataset("type.raw", data=store.types())
    own_map = store.type_map()
    if own_map is not None:
        group.create_dataset("type_map.raw", data=np.array(own_map, dtype="S"))
    if store.nopbc():
        group.create_dataset("nopbc", data=True)
    sources = _sources(system)
    if set_size is None:
        targets = [(s.name, s.start, s.start + s.nframes) for s in system.sets]
    else:
        targets = [
            (f"set.{k:03d}", a, min(a + set_size, system.nframes))
            for k, a in enumerate(range(0, system.nframes, set_size))
        ]
    filters = {}
    if compression != "none":
        filters = {"compression": compression, "shuffle": True}
    for target, first, last in targets:
        out = group.create_group(target)
        for array, (pieces, shape, dtype) in sources.items():
            if set_size is None:  # the set's own arrays only (a set may hold extra ones)
                pieces = [p for p in pieces if p.set_name == target]
                if not pieces:
                    continue
                shape, dtype = store.header(target, array)
                shape = shape[1:]
            row_bytes = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
            nrows = last - first
            chunk = max(1, min(nrows, chunk_bytes // row_bytes))
            dataset = out.create_dataset(
                array + ".npy", (nrows, *shape), dtype, chunks=(chunk, *shape), **filters
            )
            step = max(chunk, buffer_bytes // row_bytes // chunk * chunk)
            for piece in pieces:
                lo, hi = max(piece.first, first), min(piece.first + piece.stop - piece.start, last)
                for a in range(lo, hi, step):
                    b = min(a + step, hi)
                    offset = piece.start - piece.first
                    rows = np.arange(a + offset, b + offset)
                    dataset[a - first : b - first] = store.rows(piece.set_name, array, rows)
        yield from range(first, last)


def _sources(system: System) -> dict[str, tuple[list[_Piece], tuple[int, ...], np.dtype]]:
    """Every array of the system's sets: where its rows are, its row shape and dtype (those
    of the first set holding it)."""
    store = system.store
    found: dict[str, tuple[list[_Piece], tuple[int, ...], np.dtype]] = {}
    for info in system.sets:
        for array in store.array_names(info.name):
            shape, dtype = store.header(info.name, array)
            if len(shape) == 0 or shape[0] != info.nframes:
                raise MDTrainError(
                    f"{store.where(info.name, array + '.npy')}: shape {list(shape)} is not "
                    f"one row per frame ({info.nframes} frames)"
                )
            piece = _Piece(info.name, 0, info.nframes, info.start)
            if array not in found:
                found[array] = ([piece], tuple(shape[1:]), dtype)
            else:
                found[array][0].append(piece)
    return found


def _check_resplit(system: System) -> None:
    """``--set-size`` joins sets: each array must be in every set, with one shape and dtype."""
    store = system.store
    for array, (pieces, shape, dtype) in _sources(system).items():
        if len(pieces) != len(system.sets):
            raise MDTrainError(
                f"system {system.path}: {array}.npy is in {len(pieces)} of {len(system.sets)} "
                "sets: pack it without --set-size to keep its sets"
            )
        for piece in pieces:
            got_shape, got_dtype = store.header(piece.set_name, array)
            if tuple(got_shape[1:]) != shape or got_dtype != dtype:
                raise MDTrainError(
                    f"{store.where(piece.set_name, array + '.npy')}: shape or dtype differs "
                    "from the first set's: pack it without --set-size to keep its sets"
                )
