"""LMDB data sets in DeePMD-kit 3.2's layout, read lazily as mdtrain systems.

The layout (DeePMD-kit 3.2's ``deepmd/dpmodel/utils/lmdb_data.py`` reads it): an LMDB
environment, a directory holding ``data.mdb``. Key ``__metadata__`` holds a msgpack map with
``nframes``, ``frame_idx_fmt`` (default ``012d``) and optionally ``type_map`` (the names of
the stored types; other keys such as ``frame_nlocs`` are not needed here). Frame ``i`` is
stored under ``format(i, frame_idx_fmt)`` as a msgpack map whose arrays are maps
``{"type": numpy dtype, "shape": [...], "data": raw bytes}``: ``atom_types`` (N,),
``coords`` (N, 3), ``cells`` (3, 3; absent or all zero in a non-periodic frame),
``energies`` (a scalar), ``forces`` (N, 3), ``virials`` (9 or 3×3); a ``find_<label>`` of 0
marks a label the frame does not have.

One LMDB holds frames of many atom counts and compositions, and an mdtrain system has fixed
atoms, so the frames are grouped by atom types (in the stored order), periodicity and the
labels present: one pass over the records when the data set is first opened in a process
(cached, invalidated when ``data.mdb`` changes). Each group is a system ``PATH#NAME``, NAME
its formula in the stored type order (``O64H128``; a second group of the same formula is
``O64H128.1``), presented to `mdtrain.data.system.System` as one set of frames that are read
and decoded when asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mdtrain.errors import MDTrainError

#: mdtrain's array names → the keys DeePMD-kit's LMDB frames use
KEYS = {
    "coord": "coords",
    "box": "cells",
    "energy": "energies",
    "force": "forces",
    "virial": "virials",
}
_LABELS = ("energy", "force", "virial")
_SET = "set.000"  # the one set of frames a group presents
_envs: dict[tuple[int, str], Any] = {}
_indexes: dict[tuple[str, int, int], LmdbIndex] = {}


def is_lmdb(path: str) -> bool:
    """True when ``path`` (before any ``#NAME``) is an LMDB environment (holds data.mdb)."""
    return os.path.isfile(os.path.join(path.partition("#")[0], "data.mdb"))


@dataclass
class Group:
    """Frames with the same atoms: their LMDB frame numbers, in stored order."""

    name: str
    types: np.ndarray
    periodic: bool
    labels: frozenset[str]
    frames: list[int] = field(default_factory=list)


@dataclass
class LmdbIndex:
    """What one pass over an LMDB found: its type_map, key format and groups of frames."""

    path: str
    type_map: list[str] | None
    frame_fmt: str
    groups: dict[str, Group]


def lmdb_systems(path: str) -> list[str]:
    """The systems ``path`` names: every group of an LMDB, or the one ``PATH#NAME`` names."""
    file, sep, name = path.partition("#")
    index = lmdb_index(file)
    if sep and name not in index.groups:
        raise MDTrainError(
            f"system {path}: no group {name!r} in the LMDB (it has {', '.join(index.groups)})"
        )
    return [f"{file}#{n}" for n in ([name] if sep else index.groups)]


def single_group(path: str) -> str:
    """``PATH#NAME`` of an LMDB holding one group; an error naming them where it holds more."""
    systems = lmdb_systems(path)
    if len(systems) > 1:
        raise MDTrainError(
            f"system {path}: the LMDB holds {len(systems)} groups of frames; name one as "
            f"{path}#NAME or list the LMDB in 'systems' to use them all"
        )
    return systems[0]


def open_env(path: str):
    """A read-only environment for ``path``, one per process (LMDB allows no second one)."""
    import lmdb

    key = (os.getpid(), os.path.realpath(path))
    env = _envs.get(key)
    if env is None:
        try:
            env = lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False)
        except lmdb.Error as exc:
            raise MDTrainError(f"LMDB {path}: cannot open ({exc})") from None
        _envs[key] = env
    return env


def lmdb_index(path: str) -> LmdbIndex:
    """The groups of frames of the LMDB at ``path`` (see the module docstring)."""
    data = os.path.join(path, "data.mdb")
    try:
        stat = os.stat(data)
    except OSError:
        raise MDTrainError(f"LMDB {path}: no data.mdb in it") from None
    key = (os.path.realpath(path), stat.st_mtime_ns, stat.st_size)
    index = _indexes.get(key)
    if index is None:
        index = _indexes[key] = _scan(path)
    return index


def _scan(path: str) -> LmdbIndex:
    with open_env(path).begin() as txn:
        raw = txn.get(b"__metadata__")
        if raw is None:
            raise MDTrainError(f"LMDB {path}: no __metadata__ key (not DeePMD-kit's layout)")
        meta = _unpack(raw, path, "__metadata__")
        if not isinstance(meta, dict) or not isinstance(meta.get("nframes"), int):
            raise MDTrainError(f"LMDB {path}: __metadata__ has no integer 'nframes'")
        fmt = str(meta.get("frame_idx_fmt", "012d"))
        type_map = meta.get("type_map")
        type_map = [str(t) for t in type_map] if type_map is not None else None
        groups: dict[tuple, Group] = {}
        for i in range(meta["nframes"]):
            record = txn.get(format(i, fmt).encode())
            if record is None:
                raise MDTrainError(
                    f"LMDB {path}: frame {format(i, fmt)} is missing (__metadata__ says "
                    f"{meta['nframes']} frames)"
                )
            frame = _unpack(record, path, format(i, fmt))
            types = decode(frame, "atom_types", path, i).astype(np.int64).reshape(-1)
            if "coords" not in frame:
                raise MDTrainError(f"LMDB {path}: frame {format(i, fmt)} has no coords")
            if types.size and types.min() < 0:
                raise MDTrainError(
                    f"LMDB {path}: frame {format(i, fmt)} has virtual atoms (type < 0), "
                    "which mdtrain does not read"
                )
            cell = frame.get("cells")
            periodic = cell is not None and bool(np.any(decode(frame, "cells", path, i)))
            labels = frozenset(x for x in _LABELS if _has_label(frame, x))
            signature = (types.tobytes(), periodic, labels)
            if signature not in groups:
                groups[signature] = Group("", types, periodic, labels)
            groups[signature].frames.append(i)
    return LmdbIndex(path, type_map, fmt, _named(list(groups.values()), type_map))


def _named(groups: list[Group], type_map: list[str] | None) -> dict[str, Group]:
    """Groups by their formula (a suffix ``.k`` for the k-th further group of one formula)."""
    named: dict[str, Group] = {}
    for group in groups:
        counts = np.bincount(group.types)
        formula = "".join(
            f"{type_map[t] if type_map and t < len(type_map) else f'type{t}_'}{n}"
            for t, n in enumerate(counts)
            if n
        )
        name, k = formula, 0
        while name in named:
            k += 1
            name = f"{formula}.{k}"
        group.name = name
        named[name] = group
    return named


def _unpack(raw: bytes, path: str, key: str) -> Any:
    import msgpack

    try:
        return msgpack.unpackb(raw, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MDTrainError(f"LMDB {path}: record {key} is not msgpack ({exc})") from None


def _has_label(frame: dict, label: str) -> bool:
    if KEYS[label] not in frame:
        return False
    flag = frame.get(f"find_{label}", frame.get(f"find_{KEYS[label]}", 1))
    return float(np.asarray(_value(flag)).reshape(-1)[0]) != 0.0


def _value(item: Any) -> Any:
    """An encoded array as a numpy array; anything else (a number) as it is."""
    if isinstance(item, dict) and "data" in item and "type" in item:
        array = np.frombuffer(item["data"], dtype=np.dtype(item["type"]))
        return array.reshape(item["shape"]) if "shape" in item else array
    return item


def decode(frame: dict, key: str, path: str, number: int) -> np.ndarray:
    """Array ``key`` of one decoded frame; a one-line error names the frame when absent."""
    if key not in frame:
        raise MDTrainError(f"LMDB {path}: frame {number} has no {key}")
    try:
        return np.asarray(_value(frame[key]))
    except (ValueError, TypeError, KeyError) as exc:
        raise MDTrainError(f"LMDB {path}: frame {number}: {key} is not an array ({exc})") from None


class LmdbStore:
    """Read access to one group of an LMDB (``PATH#NAME``), with the interface of the npy
    and HDF5 stores (`mdtrain.data.system.System` takes any of them)."""

    kind = "deepmd/lmdb"

    def __init__(self, path: str):
        self.path = path
        self.file, _, name = path.partition("#")
        self._index = lmdb_index(self.file)
        if name not in self._index.groups:
            lmdb_systems(path)  # raises, naming the groups there are
        self._group = self._index.groups[name]
        self._shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self._recent: tuple[bytes, list[dict]] | None = None

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def frame_numbers(self) -> list[int]:
        """The LMDB frame number of each of the group's frames."""
        return list(self._group.frames)

    def where(self, set_name: str | None = None, name: str | None = None) -> str:
        """The group and the array, for error messages."""
        array = KEYS.get((name or "").removesuffix(".npy"))
        return f"{self.path} ({array})" if array else self.path

    def types(self) -> np.ndarray:
        return self._group.types

    def type_map(self) -> list[str] | None:
        return self._index.type_map

    def nopbc(self) -> bool:
        return not self._group.periodic

    def set_names(self) -> list[str]:
        return [_SET]

    def array_names(self, set_name: str) -> list[str]:
        names = ["coord"] + (["box"] if self._group.periodic else [])
        return sorted(names + list(self._group.labels))

    def header(self, set_name: str, name: str) -> tuple[tuple[int, ...], np.dtype] | None:
        """Frames × the first frame's shape, and its dtype; None for an array not stored."""
        if name not in self.array_names(set_name):
            return None
        if name not in self._shapes:
            first = self._decoded([0])[0]
            value = decode(first, KEYS[name], self.file, self._group.frames[0])
            self._shapes[name] = (value.shape, value.dtype)
        shape, dtype = self._shapes[name]
        return (len(self._group.frames), *shape), dtype

    def array(self, set_name: str, name: str) -> np.ndarray:
        return self.rows(set_name, name, np.arange(len(self._group.frames)))

    def rows(self, set_name: str, name: str, rows: np.ndarray) -> np.ndarray:
        """Frames ``rows`` of one array (the frames are decoded once for all arrays asked
        for in turn, as `System.frames` does)."""
        header = self.header(set_name, name)
        if header is None:
            raise MDTrainError(f"{self.path}: has no {KEYS.get(name, name)}")
        shape, dtype = header[0][1:], header[1]
        out = np.empty((len(rows), *shape), dtype)
        for k, frame in enumerate(self._decoded(rows)):
            number = self._group.frames[int(rows[k])]
            value = decode(frame, KEYS[name], self.file, number)
            if value.size != out[k].size:
                raise MDTrainError(
                    f"LMDB {self.file}: frame {number}: {KEYS[name]} has shape "
                    f"{list(value.shape)}, the group's first frame {list(shape)}"
                )
            out[k] = value.reshape(shape)
        return out

    def _decoded(self, rows) -> list[dict]:
        """The msgpack maps of frames ``rows`` of the group (the last request is kept)."""
        rows = np.asarray(rows, dtype=np.int64)
        if self._recent is not None and self._recent[0] == rows.tobytes():
            return self._recent[1]
        fmt = self._index.frame_fmt
        frames = []
        with open_env(self.file).begin() as txn:
            for row in rows:
                number = self._group.frames[int(row)]
                record = txn.get(format(number, fmt).encode())
                if record is None:
                    raise MDTrainError(f"LMDB {self.file}: frame {format(number, fmt)} is missing")
                frames.append(_unpack(record, self.file, format(number, fmt)))
        self._recent = (rows.tobytes(), frames)
        return frames
