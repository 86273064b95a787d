"""deepmd/npy storage: a system directory with ``type.raw`` and ``set.*/`` of ``.npy`` files.

Frame counts come from the ``.npy`` headers, so opening a system reads the start of each
file (each header parsed once); an array small enough to come whole with that read is kept
(at most ``MAX_KEPT_BYTES`` per process; a small file read twice too), larger ones are read
or memory-mapped on first use. At most ``MAX_OPEN_MAPS`` maps stay open per process, the
least recently used closed first. A store pickles as its path (DataLoader workers, object
broadcast); the receiving process reads the arrays again on demand.
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from mdtrain.errors import MDTrainError

# numpy's own header layout; anything else goes through numpy's (slower) parser
_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[a-zA-Z]\d*)', 'fortran_order': (True|False), "
    r"'shape': \(((?:\d+, )*\d*,?)\), \} *\n?$"
)


class NpyHeader(NamedTuple):
    """What the header of an ``.npy`` file says: where the data start and how they lie."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    offset: int  # bytes before the data


# numpy's header texts parsed so far (files of one size share theirs: thousands of systems
# of a few sizes parse a few texts), each with the size of its data when they can be kept
# from the first read (C order, plain dtype, a shape), else -1; None: not numpy's layout
_PARSED: dict[bytes, tuple[NpyHeader, int] | None] = {}
_MAX_PARSED = 4096
_UNSEEN = object()


def parse_npy_header(path: str, missing_ok: bool = False) -> NpyHeader | None:
    """The header of an ``.npy`` file (None for a missing file when ``missing_ok``: one
    system call fewer than asking first). numpy's own files are parsed by a regular
    expression (numpy evaluates the header as a Python literal, about 50 µs a file, which
    thousands of small systems multiply); any other header by numpy."""
    found = read_npy_start(path, missing_ok)
    return None if found is None else found[0]


def read_npy_start(
    path: str, missing_ok: bool = False, keep_bytes: int = 0
) -> tuple[NpyHeader, np.ndarray | None] | None:
    """``parse_npy_header``'s header and, for a file whose data (at most ``keep_bytes``)
    came with the header's read, those data (read-only, as stored): the first read takes
    ``HEAD_BYTES``, so that a small file costs one read whether or not its data are kept."""
    try:
        fd = os.open(path, os.O_RDONLY)  # a file object costs more than the read itself
        try:
            start = os.read(fd, HEAD_BYTES)
            if start[:7] == b"\x93NUMPY\x01" and len(start) >= 10:
                length = int.from_bytes(start[8:10], "little")
                text = start[10 : 10 + length]
                if len(text) < length:
                    text += os.pread(fd, length - len(text), 10 + len(text))
                parsed = _PARSED.get(text, _UNSEEN)
                if parsed is _UNSEEN:
                    parsed = _parse(text)
                if parsed is not None:
                    header, nbytes = parsed
                    if 0 <= nbytes <= keep_bytes and len(start) >= header.offset + nbytes:
                        # the data came whole with the header: kept, read-only, as stored
                        return header, np.ndarray(header.shape, header.dtype, start, header.offset)
                    return header, None  # read when asked (which reports a short file)
        finally:
            os.close(fd)
        with open(path, "rb") as handle:  # another layout: numpy's own parser
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
            return NpyHeader(tuple(shape), dtype, bool(fortran), handle.tell()), None
    except (OSError, ValueError, TypeError) as exc:
        if missing_ok and isinstance(exc, FileNotFoundError):
            return None
        raise MDTrainError(f"{path}: not a readable .npy file ({exc})") from None


def _parse(text: bytes) -> tuple[NpyHeader, int] | None:
    """A version 1.0 header text in numpy's own layout (None: another layout), with the size
    of its data if they can be kept (else -1), remembered."""
    match = _HEADER.match(text.decode("latin1"))
    parsed = None
    if match:
        shape = tuple(int(n) for n in match.group(3).split(",") if n.strip())
        fortran = match.group(2) == "True"
        header = NpyHeader(shape, np.dtype(match.group(1)), fortran, 10 + len(text))
        plain = shape and not fortran and not header.dtype.hasobject
        parsed = header, math.prod(shape) * header.dtype.itemsize if plain else -1
    if len(_PARSED) >= _MAX_PARSED:
        _PARSED.clear()
    _PARSED[text] = parsed
    return parsed


# Memory maps open in this process, least recently used first. A map holds a file
# descriptor (Python's mmap keeps a duplicate), so keeping every array of thousands of
# systems mapped ran out of descriptors ("Too many open files" at 4000 systems with a limit
# of 20000; clusters often allow 1024). Reopening an evicted map costs tens of µs.
_MAPS: OrderedDict[tuple[str, str, str], np.ndarray] = OrderedDict()
MAX_OPEN_MAPS = 256
DIRECT_READ_BYTES = 1 << 20  # smaller files are read, not mapped (``NpyStore.rows``)
HEAD_BYTES = 4096  # the first read of an array file: its header, and a small file whole
KEEP_BYTES = HEAD_BYTES  # arrays this small are kept from that read (none when
# DIRECT_READ_BYTES is 0: every array mapped)
MAX_KEPT_BYTES = 64 << 20  # what the stores of a process keep at most, in all
_kept_total = 0


class Listing(NamedTuple):
    """A system folder's entries, each with whether it is a file, and its ``set.*``
    folders, sorted."""

    files: dict[str, bool]
    sets: list[str]


def folder_listing(entries: Iterable[os.DirEntry]) -> Listing:
    """The `Listing` of a folder from its ``os.scandir`` entries (which know their types:
    no system call per entry)."""
    files: dict[str, bool] = {}
    sets = []
    for entry in entries:
        if entry.name.startswith("set.") and entry.is_dir():
            sets.append(entry.name)
        files[entry.name] = entry.is_file()
    return Listing(files, sorted(sets))


class NpyStore:
    """Read access to one system directory.

    Its folder and each set's folder are listed once, so that an array or text file that
    is absent costs no system call. A small array (at most ``KEEP_BYTES``) arrives whole
    with its header's read and is kept (`kept_bytes` in all, up to ``MAX_KEPT_BYTES`` per
    process): thousands of small systems are then read once, when they are opened, however
    many passes (checks, statistics, fingerprints) go over their frames. With
    ``list_sets`` False a set's folder is listed only when its arrays are asked for
    (`listed_arrays`): a header is read straight away (an absent file costs one failed
    open), cheaper when a few arrays are read (coordinates and cells, for neighbour
    statistics). ``listing``: the folder's entries, when whoever found the system has just
    listed them (`expand_systems`), so that it is not listed again.
    """

    kind = "deepmd/npy"

    def __init__(self, path: str, list_sets: bool = True, listing: Listing | None = None):
        self.path = path
        self._list_sets = list_sets
        self._headers: dict[tuple[str, str], NpyHeader] = {}
        self._kept: dict[tuple[str, str], np.ndarray] = {}
        self._kept_bytes = 0
        self._read_before: set[tuple[str, str]] = set()  # arrays `rows` has read rows of
        # the folder's entries (is it a file), and its sets
        self._files: dict[str, bool] | None = None if listing is None else listing.files
        self._sets: list[str] = [] if listing is None else list(listing.sets)
        self._arrays: dict[str, frozenset[str]] = {}  # each set's entries

    def __del__(self) -> None:
        global _kept_total
        _kept_total -= getattr(self, "_kept_bytes", 0)

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def where(self, set_name: str | None = None, name: str | None = None) -> str:
        """A file path for error messages."""
        parts = [self.path] + [p for p in (set_name, name) if p]
        return os.path.join(*parts)

    def _listing(self) -> dict[str, bool]:
        """The folder's entries, each with whether it is a file (listed once)."""
        if self._files is None:
            with os.scandir(self.path) as entries:
                self._files, self._sets = folder_listing(entries)
        return self._files

    def text(self, name: str) -> str | None:
        """The text of a file of the system's folder (``type.raw``), None when absent."""
        file = f"{self.path}{os.sep}{name}"
        if not self._listing().get(name, False):
            return None
        try:
            fd = os.open(file, os.O_RDONLY)  # no file object: two system calls fewer
            try:
                parts = [os.read(fd, HEAD_BYTES)]
                # a regular file's read is short only at its end: a short first read is
                # the whole file (one system call fewer for thousands of small texts)
                while len(parts[0]) == HEAD_BYTES and parts[-1]:
                    parts.append(os.read(fd, 1 << 20))
            finally:
                os.close(fd)
            return b"".join(parts).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise MDTrainError(f"{file}: cannot read ({exc})") from None

    def types(self, text: str | None = None) -> np.ndarray | None:
        """Contents of type.raw as integers, or None when the file is missing; ``text``:
        the file's text, when it was just read (`text`)."""
        text = self.text("type.raw") if text is None else text
        if text is None:
            return None
        words = text.split()
        try:  # integers as written (faster), else as numbers written with a point
            return np.array(_integers(words), dtype=np.int64)
        except ValueError:
            raise MDTrainError(
                f"{self.where(name='type.raw')}: expected whitespace-separated integers"
            ) from None

    def type_map(self) -> list[str] | None:
        text = self.text("type_map.raw")
        return None if text is None else text.split()

    def nopbc(self) -> bool:
        return self._listing().get("nopbc", False)

    def set_names(self) -> list[str]:
        self._listing()
        return list(self._sets)

    def array_names(self, set_name: str) -> list[str]:
        """Every array of a set (``.npy`` files, named without the suffix), sorted."""
        folder = os.path.join(self.path, set_name)
        return sorted(
            entry.name[:-4]
            for entry in os.scandir(folder)
            if entry.name.endswith(".npy") and entry.is_file()
        )

    def _set_entries(self, set_name: str) -> frozenset[str]:
        entries = self._arrays.get(set_name)
        if entries is None:
            try:
                entries = frozenset(os.listdir(f"{self.path}{os.sep}{set_name}"))
            except OSError:  # let the header's own read report it
                return frozenset()
            self._arrays[set_name] = entries
        return entries

    def listed_arrays(self, set_name: str) -> frozenset[str] | None:
        """The arrays a set's folder lists (named without the suffix; None: the folder
        cannot be listed), so that `header` is asked only about those."""
        entries = self._set_entries(set_name)
        if not entries:
            return None
        return frozenset(name[:-4] for name in entries if name.endswith(".npy"))

    def header(self, set_name: str, name: str) -> tuple[tuple[int, ...], np.dtype] | None:
        """Shape and dtype of ``set_name/name.npy``, or None when absent."""
        global _kept_total
        entries = self._set_entries(set_name) if self._list_sets else self._arrays.get(set_name)
        if entries and name + ".npy" not in entries:
            return None
        file = f"{self.path}{os.sep}{set_name}{os.sep}{name}.npy"
        keep = KEEP_BYTES if DIRECT_READ_BYTES and _kept_total < MAX_KEPT_BYTES else 0
        found = read_npy_start(file, missing_ok=True, keep_bytes=keep)
        if found is None:
            return None
        header, data = found
        self._headers[(set_name, name)] = header  # the memory map needs it again
        if data is not None:
            previous = self._kept.get((set_name, name))
            self._kept[(set_name, name)] = data
            grown = data.nbytes - (0 if previous is None else previous.nbytes)
            self._kept_bytes += grown
            _kept_total += grown
        return header.shape, header.dtype

    def absent(self, set_name: str, name: str) -> bool:
        """Whether ``set_name/name.npy`` is known to be absent: from the set's listing when
        it was listed, else by one existence check (cheaper than a failed read)."""
        entries = self._set_entries(set_name) if self._list_sets else self._arrays.get(set_name)
        if entries:
            return name + ".npy" not in entries
        return not os.access(f"{self.path}{os.sep}{set_name}{os.sep}{name}.npy", os.F_OK)

    def kept(self, set_name: str, name: str) -> np.ndarray | None:
        """The whole array when it came with its header's read (read-only, as stored), else
        None."""
        return self._kept.get((set_name, name))

    def array(self, set_name: str, name: str) -> np.ndarray:
        """The whole array, memory-mapped or kept (no copy, read-only); see ``_MAPS`` for
        how many maps stay open."""
        kept = self._kept.get((set_name, name))
        if kept is not None:
            return kept
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
        small systems the maps kept open are evicted before they are used again. Asked again
        (training asks every step), it is read whole and kept: no open and read (17 µs).
        """
        global _kept_total
        kept = self._kept.get((set_name, name))
        if kept is not None:
            return kept.take(rows, axis=0)
        header = self._headers.get((set_name, name))
        plain = header is not None and len(header.shape) and not header.fortran_order
        if not (plain and not header.dtype.hasobject and len(rows)) or (
            header.shape[0] * _row_bytes(header) > DIRECT_READ_BYTES
        ):
            return np.array(self.array(set_name, name)[as_slice(rows)])
        first, last = int(rows[0]), int(rows[-1]) + 1
        if first < 0 or last > header.shape[0]:
            raise IndexError(f"rows {first}..{last - 1} outside 0..{header.shape[0] - 1}")
        again = (set_name, name) in self._read_before and _kept_total < MAX_KEPT_BYTES
        self._read_before.add((set_name, name))
        if again:  # asked again (training asks every step): read whole, and kept
            first, last = 0, header.shape[0]
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
        if again:
            out.flags.writeable = False  # as the arrays kept with their headers
            self._kept[(set_name, name)] = out
            self._kept_bytes += out.nbytes
            _kept_total += out.nbytes
            return out.take(rows, axis=0)
        return out if last - first == len(rows) else out[rows - first]


def _integers(words: list[str]) -> list[int]:
    try:
        return list(map(int, words))
    except ValueError:
        return [int(float(word)) for word in words]


def _row_bytes(header: NpyHeader) -> int:
    return math.prod(header.shape[1:]) * header.dtype.itemsize


def as_slice(rows: np.ndarray) -> slice | np.ndarray:
    """A slice when ``rows`` (sorted, unique) is a contiguous run: cheaper to read."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


def row_bounds(index: np.ndarray) -> tuple[int, int]:
    """The smallest and largest of some frame numbers: a few (a batch, a system's frames)
    cost less as a Python list than two numpy reductions."""
    if len(index) <= 64:
        values = index.tolist()
        return min(values), max(values)
    return int(index.min()), int(index.max())
