"""deepmd/npy storage: a system directory with ``type.raw`` and ``set.*/`` of ``.npy`` files.

Arrays are memory-mapped on first use and frame counts come from the ``.npy`` headers, so
opening a system reads a few bytes per file (each header parsed once). At most
``MAX_OPEN_MAPS`` maps stay open per process, the least recently used closed first. A store
pickles as its path (DataLoader workers, object broadcast); the receiving process maps the
arrays again on demand.
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mdtrain.errors import MDTrainError

# numpy's own header layout; anything else goes through numpy's (slower) parser
_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[a-zA-Z]\d*)', 'fortran_order': (True|False), "
    r"'shape': \(((?:\d+, )*\d*,?)\), \} *\n?$"
)


@dataclass(frozen=True)
class NpyHeader:
    """What the header of an ``.npy`` file says: where the data start and how they lie."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    offset: int  # bytes before the data


def parse_npy_header(path: str, missing_ok: bool = False) -> NpyHeader | None:
    """The header of an ``.npy`` file (None for a missing file when ``missing_ok``: one
    system call fewer than asking first). numpy's own files are parsed by a regular
    expression (numpy evaluates the header as a Python literal, about 50 µs a file, which
    thousands of small systems multiply); any other header by numpy."""
    try:
        with open(path, "rb", buffering=0) as handle:
            start = handle.read(128)  # numpy pads its headers to 64-byte multiples: one read
            if len(start) >= 10 and start[:6] == b"\x93NUMPY" and start[6] == 1:
                length = int.from_bytes(start[8:10], "little")
                text = start[10 : 10 + length]
                if len(text) < length:
                    text += handle.read(length - len(text))
                match = _HEADER.match(text.decode("latin1"))
                if match:
                    shape = tuple(int(n) for n in match.group(3).split(",") if n.strip())
                    fortran = match.group(2) == "True"
                    return NpyHeader(shape, np.dtype(match.group(1)), fortran, 10 + length)
            handle.seek(0)
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
            return NpyHeader(tuple(shape), dtype, bool(fortran), handle.tell())
    except (OSError, ValueError, TypeError) as exc:
        if missing_ok and isinstance(exc, FileNotFoundError):
            return None
        raise MDTrainError(f"{path}: not a readable .npy file ({exc})") from None


def read_npy_header(path: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of an ``.npy`` file, from its header only."""
    header = parse_npy_header(path)
    return header.shape, header.dtype


# Memory maps open in this process, least recently used first. A map holds a file
# descriptor (Python's mmap keeps a duplicate), so keeping every array of thousands of
# systems mapped ran out of descriptors ("Too many open files" at 4000 systems with a limit
# of 20000; clusters often allow 1024). Reopening an evicted map costs tens of µs.
_MAPS: OrderedDict[tuple[str, str, str], np.ndarray] = OrderedDict()
MAX_OPEN_MAPS = 256
DIRECT_READ_BYTES = 1 << 20  # smaller files are read, not mapped (``NpyStore.rows``)


class NpyStore:
    """Read access to one system directory."""

    kind = "deepmd/npy"

    def __init__(self, path: str):
        self.path = path
        self._headers: dict[tuple[str, str], NpyHeader] = {}

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
        file = f"{self.path}{os.sep}{set_name}{os.sep}{name}.npy"
        header = parse_npy_header(file, missing_ok=True)
        if header is None:
            return None
        self._headers[(set_name, name)] = header  # the memory map needs it again
        return header.shape, header.dtype

    def array(self, set_name: str, name: str) -> np.ndarray:
        """The whole array, memory-mapped (no copy); see ``_MAPS`` for how many stay open."""
        key = (self.path, set_name, name)
        mapped = _MAPS.get(key)
        if mapped is not None:
            _MAPS.move_to_end(key)
        else:
            file = os.path.join(self.path, set_name, name + ".npy")
            header = self._headers.get((set_name, name))
            try:
                if header is None or header.fortran_order or header.dtype.hasobject:
                    mapped = np.load(file, mmap_mode="r", allow_pickle=False)
                elif 0 in header.shape:  # nothing to map
                    mapped = np.empty(header.shape, header.dtype)
                else:  # the header read when the system was opened, not parsed again
                    mapped = np.memmap(file, header.dtype, "r", header.offset, header.shape)
            except (OSError, ValueError) as exc:
                raise MDTrainError(f"{file}: cannot read ({exc})") from None
            _MAPS[key] = mapped
            while len(_MAPS) > MAX_OPEN_MAPS:
                _MAPS.popitem(last=False)  # the least recently used; its descriptor closes
        return mapped

    def rows(self, set_name: str, name: str, rows: np.ndarray) -> np.ndarray:
        """Frames ``rows`` (sorted, unique) of one array, copied into memory.

        A file of at most ``DIRECT_READ_BYTES`` is read (the bytes from the first row asked
        to the last) instead of mapped: mapping costs about 90 µs, and with thousands of
        small systems the maps kept open are evicted before they are used again.
        """
        header = self._headers.get((set_name, name))
        if (
            header is None
            or header.fortran_order
            or header.dtype.hasobject
            or not len(header.shape)
            or header.shape[0] * _row_bytes(header) > DIRECT_READ_BYTES
            or not len(rows)
        ):
            return np.array(self.array(set_name, name)[as_slice(rows)])
        first, last = int(rows[0]), int(rows[-1]) + 1
        if first < 0 or last > header.shape[0]:
            raise IndexError(f"rows {first}..{last - 1} outside 0..{header.shape[0] - 1}")
        size = _row_bytes(header)
        out = np.empty((last - first, *header.shape[1:]), header.dtype)
        file = f"{self.path}{os.sep}{set_name}{os.sep}{name}.npy"
        try:
            with open(file, "rb", buffering=0) as handle:
                whole = os.fstat(handle.fileno()).st_size >= header.offset + header.shape[0] * size
                handle.seek(header.offset + first * size)
                got = handle.readinto(memoryview(out).cast("B"))
        except OSError as exc:
            raise MDTrainError(f"{file}: cannot read ({exc})") from None
        if got != out.nbytes or not whole:
            raise MDTrainError(f"{file}: cannot read (shorter than its header says)")
        return out if last - first == len(rows) else out[rows - first]


def _row_bytes(header: NpyHeader) -> int:
    return math.prod(header.shape[1:]) * header.dtype.itemsize


def as_slice(rows: np.ndarray) -> slice | np.ndarray:
    """A slice when ``rows`` (sorted, unique) is a contiguous run: cheaper to read."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows
