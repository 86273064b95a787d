"""deepmd/hdf5 storage: the deepmd/npy tree inside an HDF5 group (``file.h5#/group``).

A file name of the npy layout is a dataset key here (``/water/set.000/coord.npy``). File
handles are opened on demand and cached per process; the cache is keyed by the process id so
that a forked DataLoader worker opens its own handles instead of sharing the parent's, and a
handle is reopened when the file changed on disk (rewritten by a test or a converter).
Files are read without a chunk cache, and only the ``MAX_OPEN_OBJECTS`` most recently used
groups and datasets stay open, so that memory does not grow with the number of systems and
sets read (both grew by gigabytes on large data sets).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from mdtrain.data.npy import as_slice
from mdtrain.errors import MDTrainError

if TYPE_CHECKING:  # h5py is imported on first use: `import mdtrain.data` stays quick
    import h5py

_handles: dict[str, tuple[tuple[int, int, int], h5py.File]] = {}
_owner_pid = os.getpid()


def split_h5_path(path: str) -> tuple[str, str]:
    """``"file.h5#/a/b"`` → ``("file.h5", "/a/b")``; no ``#`` means the root group."""
    file, _, group = path.partition("#")
    group = "/" + group.strip("/")
    return file, group


def join_h5_path(file: str, group: str) -> str:
    return f"{file}#/{group.strip('/')}"


def is_hdf5(path: str) -> bool:
    """True for a readable HDF5 file (by its signature, not its name)."""
    import h5py

    try:
        return os.path.isfile(path) and h5py.is_hdf5(path)
    except OSError:
        return False


def open_h5(file: str) -> h5py.File:
    """A read-only handle to ``file``, cached for this process."""
    import h5py

    global _owner_pid
    if os.getpid() != _owner_pid:
        # handles inherited through fork belong to the parent: forget them, never close them
        _handles.clear()
        _owner_pid = os.getpid()
    key = os.path.abspath(file)
    try:
        stat = os.stat(key)
    except OSError as exc:
        raise MDTrainError(f"{file}: cannot open HDF5 file ({exc.strerror})") from None
    signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    cached = _handles.get(key)
    if cached is not None:
        if cached[0] == signature and cached[1].id.valid:
            return cached[1]
        close_h5(file)
    try:
        handle = h5py.File(h5py.h5f.open(key.encode(), h5py.h5f.ACC_RDONLY, _access_list()))
    except OSError as exc:
        raise MDTrainError(f"{file}: not a readable HDF5 file ({exc})") from None
    _handles[key] = (signature, handle)
    return handle


METADATA_CACHE_BYTES = 4 << 20


def _access_list():
    """How mdtrain opens files: without a chunk cache (h5py's grows with every chunked
    dataset read: 2 GB after a scan of the 640 datasets of a 4 GB file, kept while training
    runs; frames of an uncompressed file read as fast without it, and ``--pack`` cuts
    compressed data into small chunks), and a metadata cache of at most
    ``METADATA_CACHE_BYTES`` (the library's own limit let it reach 200 MB on a file of 5000
    systems)."""
    import h5py

    access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    access.set_cache(0, 521, 0, 0.75)  # metadata slots (unused), chunk slots, bytes, w0
    config = access.get_mdc_config()
    config.set_initial_size = True
    config.initial_size = min(config.initial_size, METADATA_CACHE_BYTES)
    config.min_size = min(config.min_size, METADATA_CACHE_BYTES)
    config.max_size = METADATA_CACHE_BYTES
    access.set_mdc_config(config)
    return access


def close_h5(file: str | None = None) -> None:
    """Close the cached handle of ``file`` (all handles when None), e.g. before rewriting it."""
    keys = list(_handles) if file is None else [os.path.abspath(file)]
    for key in keys:
        cached = _handles.pop(key, None)
        if cached is not None and os.getpid() == _owner_pid:
            cached[1].close()


def find_h5_systems(file: str, group: str = "/") -> list[str]:
    """Every group at or under ``group`` that holds a ``type.raw`` dataset, as group paths."""
    import h5py

    root = open_h5(file)
    if group not in root or not isinstance(root[group], h5py.Group):
        raise MDTrainError(f"{join_h5_path(file, group)}: no such group in {file}")
    found = []

    def walk(node: h5py.Group) -> None:
        # set.* groups never hold systems: skip them and every dataset (a file of thousands
        # of systems holds tens of thousands of them, and each one opened costs time and
        # memory of the library)
        if "type.raw" in node:
            found.append(node.name)
        for name in node:
            if not name.startswith("set.") and node.get(name, getclass=True) is h5py.Group:
                walk(node[name])

    walk(root[group])
    return sorted(set(found))


# Groups and datasets open in this process, least recently used first, with the file handle
# they were opened from. An open HDF5 object keeps its header in the library's memory: 5000
# systems with every dataset kept open held 850 MB before any frame was read.
_OBJECTS: OrderedDict[tuple[str, str], tuple[h5py.File, object]] = OrderedDict()
_objects_pid = os.getpid()
_inherited: list = []  # objects opened by a parent process: never closed here
MAX_OPEN_OBJECTS = 512


def _lookup(root: h5py.File, path: str) -> object | None:
    """``root.get(path)`` (None when absent), kept open among the recently used."""
    global _objects_pid
    if os.getpid() != _objects_pid:
        _inherited.extend(_OBJECTS.values())
        _OBJECTS.clear()
        _objects_pid = os.getpid()
    key = (root.filename, path)
    cached = _OBJECTS.get(key)
    if cached is not None and cached[0] is root:
        _OBJECTS.move_to_end(key)
        return cached[1]
    obj = root.get(path)
    _OBJECTS[key] = (root, obj)
    _OBJECTS.move_to_end(key)
    while len(_OBJECTS) > MAX_OPEN_OBJECTS:
        _OBJECTS.popitem(last=False)
    return obj


class H5Store:
    """Read access to one system group of an HDF5 file."""

    kind = "deepmd/hdf5"

    def __init__(self, file: str, group: str):
        self.file = file
        self.group = "/" + group.strip("/")
        self.path = join_h5_path(file, self.group)
        self._group()  # fail now on a missing file or group

    def __getstate__(self) -> dict:
        return {"file": self.file, "group": self.group}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["file"], state["group"])

    def _group(self) -> h5py.Group:
        """The system group (looked up again after the file was reopened or evicted)."""
        import h5py

        group = _lookup(open_h5(self.file), self.group)
        if group is None:
            raise MDTrainError(f"{self.path}: no such group in {self.file}")
        if not isinstance(group, h5py.Group):
            raise MDTrainError(f"{self.path}: is a dataset, not a group")
        return group

    def where(self, set_name: str | None = None, name: str | None = None) -> str:
        parts = [p for p in (set_name, name) if p]
        return self.path.rstrip("/") + ("/" + "/".join(parts) if parts else "")

    def _dataset(self, name: str) -> h5py.Dataset | None:
        """The dataset ``name`` of the system group (None when absent)."""
        import h5py

        root = open_h5(self.file)
        if _lookup(root, self.group) is None:
            self._group()  # raises the missing-group error
        obj = _lookup(root, f"{self.group.rstrip('/')}/{name}")
        if obj is not None and not isinstance(obj, h5py.Dataset):
            raise MDTrainError(f"{self.where(name=name)}: expected a dataset")
        return obj

    def _read(self, dataset: h5py.Dataset, name: str) -> np.ndarray:
        try:
            return np.asarray(dataset[()])
        except OSError as exc:
            raise MDTrainError(f"{self.where(name=name)}: cannot read ({exc})") from None

    def _words(self, name: str) -> list[str] | None:
        dataset = self._dataset(name)
        if dataset is None:
            return None
        values = np.atleast_1d(self._read(dataset, name))
        words: list[str] = []
        for value in values.tolist():
            text = value.decode() if isinstance(value, bytes) else str(value)
            words.extend(text.split())
        return words

    def types(self) -> np.ndarray | None:
        words = self._words("type.raw")
        if words is None:
            return None
        try:
            return np.array([int(float(word)) for word in words], dtype=np.int64)
        except ValueError:
            raise MDTrainError(f"{self.where(name='type.raw')}: expected integers") from None

    def type_map(self) -> list[str] | None:
        return self._words("type_map.raw")

    def nopbc(self) -> bool:
        return "nopbc" in self._group()

    def set_names(self) -> list[str]:
        import h5py

        group = self._group()
        return sorted(
            name
            for name in group
            if name.startswith("set.") and isinstance(group[name], h5py.Group)
        )

    def array_names(self, set_name: str) -> list[str]:
        """Every array of a set (datasets named ``*.npy``, without the suffix), sorted."""
        import h5py

        group = self._group()[set_name]
        return sorted(
            name[:-4]
            for name, obj in group.items()
            if name.endswith(".npy") and isinstance(obj, h5py.Dataset)
        )

    def header(self, set_name: str, name: str) -> tuple[tuple[int, ...], np.dtype] | None:
        dataset = self._dataset(f"{set_name}/{name}.npy")
        return None if dataset is None else (tuple(dataset.shape), dataset.dtype)

    def array(self, set_name: str, name: str) -> np.ndarray:
        dataset = self._dataset(f"{set_name}/{name}.npy")
        return self._read(dataset, f"{set_name}/{name}.npy")

    def rows(self, set_name: str, name: str, rows: np.ndarray) -> np.ndarray:
        """Frames ``rows`` (sorted, unique) of one dataset: h5py reads only those."""
        dataset = self._dataset(f"{set_name}/{name}.npy")
        try:
            return np.asarray(dataset[as_slice(rows)])
        except OSError as exc:
            raise MDTrainError(
                f"{self.where(set_name, name + '.npy')}: cannot read ({exc})"
            ) from None
