"""deepmd/npy storage: a system directory with ``type.raw`` and ``set.*/`` of ``.npy`` files.

Arrays are memory-mapped on first use and frame counts come from the ``.npy`` headers, so
opening a system reads a few bytes per file. Memory maps are dropped when a store is pickled
(DataLoader workers, object broadcast) and re-opened on demand in the receiving process.
"""

from __future__ import annotations

import os

import numpy as np

from mdtrain.errors import MDTrainError


def read_npy_header(path: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of an ``.npy`` file, from its header only."""
    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(handle)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(handle)
    except (OSError, ValueError) as exc:
        raise MDTrainError(f"{path}: not a readable .npy file ({exc})") from None
    return tuple(shape), dtype


class NpyStore:
    """Read access to one system directory."""

    kind = "deepmd/npy"

    def __init__(self, path: str):
        self.path = path
        self._maps: dict[tuple[str, str], np.ndarray] = {}

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def where(self, set_name: str | None = None, name: str | None = None) -> str:
        """A file path for error messages."""
        parts = [self.path] + [p for p in (set_name, name) if p]
        return os.path.join(*parts)

    def _text(self, name: str) -> str | None:
        file = os.path.join(self.path, name)
        if not os.path.isfile(file):
            return None
        try:
            with open(file, encoding="utf-8") as handle:
                return handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise MDTrainError(f"{file}: cannot read ({exc})") from None

    def types(self) -> np.ndarray | None:
        """Contents of type.raw as integers, or None when the file is missing."""
        text = self._text("type.raw")
        if text is None:
            return None
        try:
            return np.array([int(float(word)) for word in text.split()], dtype=np.int64)
        except ValueError:
            raise MDTrainError(
                f"{self.where(name='type.raw')}: expected whitespace-separated integers"
            ) from None

    def type_map(self) -> list[str] | None:
        text = self._text("type_map.raw")
        return None if text is None else text.split()

    def nopbc(self) -> bool:
        return os.path.isfile(os.path.join(self.path, "nopbc"))

    def set_names(self) -> list[str]:
        names = [
            entry.name
            for entry in os.scandir(self.path)
            if entry.name.startswith("set.") and entry.is_dir()
        ]
        return sorted(names)

    def array_names(self, set_name: str) -> list[str]:
        """Every array of a set (``.npy`` files, named without the suffix), sorted."""
        folder = os.path.join(self.path, set_name)
        return sorted(
            entry.name[:-4]
            for entry in os.scandir(folder)
            if entry.name.endswith(".npy") and entry.is_file()
        )

    def header(self, set_name: str, name: str) -> tuple[tuple[int, ...], np.dtype] | None:
        """Shape and dtype of ``set_name/name.npy``, or None when absent."""
        file = os.path.join(self.path, set_name, name + ".npy")
        if not os.path.isfile(file):
            return None
        return read_npy_header(file)

    def array(self, set_name: str, name: str) -> np.ndarray:
        """The whole array, memory-mapped (no copy)."""
        key = (set_name, name)
        mapped = self._maps.get(key)
        if mapped is None:
            file = os.path.join(self.path, set_name, name + ".npy")
            try:
                mapped = np.load(file, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise MDTrainError(f"{file}: cannot read ({exc})") from None
            self._maps[key] = mapped
        return mapped

    def rows(self, set_name: str, name: str, rows: np.ndarray) -> np.ndarray:
        """Frames ``rows`` (sorted, unique) of one array, copied into memory."""
        return np.array(self.array(set_name, name)[as_slice(rows)])


def as_slice(rows: np.ndarray) -> slice | np.ndarray:
    """A slice when ``rows`` (sorted, unique) is a contiguous run: cheaper to read."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows
