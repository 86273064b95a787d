"""Neighbour lists: one code path for neighbor-stat, statistics, training and inference.

Pairs come from the compiled ``vesin`` cell list. Indices and integer image shifts are
computed here, outside autograd; the model rebuilds distance vectors from them as
``coord[j] - coord[i] + shift @ box`` so that forces and virials flow through the positions
and the cell only.

The ``vesin`` Python package imports torch when it is installed (≈1 s), which would make
``mdtrain neighbor-stat`` start slowly. So the compiled library is called here through a thin
ctypes binding, using the package's own declaration of its C structures (so the layout always
matches the installed library); if that is not possible, the package's ``NeighborList`` is
used instead.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass

import numpy as np

from mdtrain.neighbors.slots import padded_lists, pair_order

_ZERO_BOX = np.zeros((3, 3))
_NO_PBC = np.zeros(3, dtype=np.bool_)
_ALL_PBC = np.ones(3, dtype=np.bool_)


@dataclass(frozen=True)
class Pairs:
    """All ordered pairs (i, j, shift) with |r_j - r_i + shift @ box| < rcut, self excluded."""

    i: np.ndarray  # (npairs,) int64, centre atom
    j: np.ndarray  # (npairs,) int64, neighbour atom
    shift: np.ndarray  # (npairs, 3) int64, image of j in units of the cell vectors
    dist: np.ndarray  # (npairs,) float64


class _CBinding:
    """The compiled vesin library and its C structures, loaded once per process."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("vesin")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("vesin is not installed")
        root = list(spec.submodule_search_locations)[0]
        api_spec = importlib.util.spec_from_file_location(
            "_mdtrain_vesin_c_api", os.path.join(root, "_c_api.py")
        )
        if api_spec is None or api_spec.loader is None:
            raise ImportError("vesin C API declarations not found")
        api = importlib.util.module_from_spec(api_spec)
        api_spec.loader.exec_module(api)
        name = "libvesin.dylib" if sys.platform == "darwin" else "libvesin.so"
        lib = ctypes.CDLL(os.path.join(root, "lib", name))
        api.setup_functions(lib)
        # The call below follows the C API of vesin >= 0.5 (device argument, 8 parameters).
        if len(lib.vesin_neighbors.argtypes) != 8 or not hasattr(api, "VesinDevice"):
            raise ImportError("unsupported vesin C API version")
        self.api = api
        self.lib = lib
        self.cpu = api.VesinDevice(api.VesinCPU, 0)
        self.option_fields = {name for name, _ in api.VesinOptions._fields_}


_binding: _CBinding | None = None
_binding_failed = False
_binding_lock = threading.Lock()


def _get_binding() -> _CBinding | None:
    global _binding, _binding_failed
    if _binding is None and not _binding_failed:
        with _binding_lock:
            if _binding is None and not _binding_failed:
                try:
                    _binding = _CBinding()
                except (ImportError, OSError, AttributeError):
                    _binding_failed = True
    return _binding


class NeighborSearch:
    """A reusable neighbour search at one cutoff; keeps the library's buffers between frames.

    Not thread-safe: use one object per thread (``neighbor_pairs`` does this for you).
    ``threads`` > 1 splits each search over the library's own threads (worth it for frames
    of a few hundred atoms and more).
    """

    def __init__(self, rcut: float, threads: int = 1, small_cells: bool = True) -> None:
        self.rcut = float(rcut)
        self.threads = max(1, int(threads))
        self.small_cells = small_cells  # False: `window.search_window` leaves every frame to
        # the library
        self._binding = _get_binding()
        if self._binding is not None:
            self._result = self._binding.api.VesinNeighborList()
            self._option_cache: dict[tuple[bool, bool, bool], object] = {}
        else:  # fallback: the Python package (imports torch when installed)
            import vesin

            self._full = vesin.NeighborList(
                cutoff=self.rcut, full_list=True, n_threads=self.threads
            )
            self._half = vesin.NeighborList(
                cutoff=self.rcut, full_list=False, n_threads=self.threads
            )

    def __del__(self) -> None:
        binding = getattr(self, "_binding", None)
        if binding is not None and hasattr(self, "_result"):
            binding.lib.vesin_free(ctypes.byref(self._result))

    def compute(
        self,
        coord: np.ndarray,
        box: np.ndarray | None,
        full: bool = True,
        shifts: bool = True,
        copy: bool = True,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """Raw pairs ``(i, j, shift, dist)`` with dist < rcut (strict).

        ``full=False`` returns each pair once (either direction); a self-image pair of atom
        ``i`` then appears once for the two images ``±shift``. ``shift`` is None unless asked.
        With ``copy=False`` the arrays may be views of this object's buffers, valid only
        until its next call (cheaper when they are consumed at once).
        """
        i, j, shift, dist, _ = self._search(coord, box, full, shifts, False, copy)
        return i, j, shift, dist

    def half_vectors(
        self, coord: np.ndarray, box: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Half-list pairs ``(i, j, vec, dist)``, ``vec`` the (n, 3) vectors from ``i`` to
        the image of ``j`` as the library computes them (no shifts to multiply out here),
        views of this object's buffers valid until its next call."""
        i, j, _, dist, vec = self._search(coord, box, False, False, True, False)
        return i, j, vec, dist

    def _search(self, coord, box, full, shifts, vectors, copy):
        """``(i, j, shift, dist, vec)``; shift and vec are None unless asked."""
        coord = np.ascontiguousarray(coord, dtype=np.float64)
        if coord.ndim != 2 or coord.shape[1] != 3:
            raise ValueError(f"coordinates must have shape (natoms, 3), got {coord.shape}")
        periodic = box is not None
        cell = _ZERO_BOX if box is None else np.ascontiguousarray(box, dtype=np.float64)
        if cell.shape != (3, 3):
            raise ValueError(f"cell must have shape (3, 3), got {cell.shape}")
        if self._binding is None:
            calculator = self._full if full else self._half
            quantities = "ij" + ("S" if shifts else "") + ("D" if vectors else "") + "d"
            out = calculator.compute(coord, cell, periodic, quantities=quantities, copy=True)
            i, j, dist = out[0].astype(np.int64), out[1].astype(np.int64), out[-1]
            shift = out[2].astype(np.int64) if shifts else None
            vec = out[-2] if vectors else None
        else:
            i, j, shift, dist, vec = self._compute_c(coord, cell, periodic, full, shifts, vectors)
        keep = dist < self.rcut  # the library includes pairs at exactly rcut; ours is strict
        if not keep.all():
            i, j, dist = i[keep], j[keep], dist[keep]
            shift = None if shift is None else shift[keep]
            vec = None if vec is None else vec[keep]
        elif copy and self._binding is not None:
            i, j, dist = i.copy(), j.copy(), dist.copy()
            shift = None if shift is None else shift.copy()
            vec = None if vec is None else vec.copy()
        return i, j, shift, dist, vec

    def half_pairs(
        self, coord: np.ndarray, box: np.ndarray | None, vectors: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Half-list pairs ``(i, j, dist, vec)`` of one frame, arrays the caller may keep
        (``vec``, from ``i`` to ``j``'s image, None unless asked)."""
        i, j, _, dist, vec = self._search(coord, box, False, False, vectors, True)
        return i, j, dist, vec

    def pairs(self, coord: np.ndarray, box: np.ndarray | None) -> Pairs:
        """Full (both directions) pairs with their image shifts."""
        i, j, shift, dist = self.compute(coord, box, full=True, shifts=True)
        return Pairs(i=i, j=j, shift=shift, dist=dist)

    def _options(self, full: bool, shifts: bool, vectors: bool):
        options = self._option_cache.get((full, shifts, vectors))
        if options is None:
            options = self._binding.api.VesinOptions()
            options.cutoff = self.rcut
            options.full = full
            options.sorted = False
            options.return_shifts = shifts
            options.return_distances = True
            options.return_vectors = vectors
            if "n_threads" in self._binding.option_fields:
                # The library runs one search at a time per process (its thread pool is
                # shared), so parallelism comes from its threads, not from ours.
                options.n_threads = self.threads
            self._option_cache[(full, shifts, vectors)] = options
        return options

    def _compute_c(self, coord, cell, periodic, full, shifts, vectors):
        """Call the library; returns views of its buffers (int64 indices and shifts)."""
        binding = self._binding
        pbc = _ALL_PBC if periodic else _NO_PBC
        error = ctypes.c_char_p()
        status = binding.lib.vesin_neighbors(
            coord.ctypes.data_as(_DOUBLE_P),
            coord.shape[0],
            cell.ctypes.data_as(_DOUBLE_P),
            pbc.ctypes.data_as(_BOOL_P),
            binding.cpu,
            self._options(full, shifts, vectors),
            ctypes.byref(self._result),
            ctypes.byref(error),
        )
        if status != 0:
            message = error.value.decode("utf8", "replace") if error.value else "unknown error"
            raise ValueError(f"neighbour search failed: {message}")
        result = self._result
        n = int(result.length)
        # size_t pair indices are far below 2**63: reading them as int64 is exact
        pairs = _view(result.pairs, (n, 2), _SIZE_T).view(np.int64)
        dist = _view(result.distances, (n,), "<f8")
        shift = _view(result.shifts, (n, 3), "<i4").astype(np.int64) if shifts else None
        vec = _view(result.vectors, (n, 3), "<f8") if vectors else None
        return pairs[:, 0], pairs[:, 1], shift, dist, vec


class _Buffer:
    """Exposes C memory to numpy through the array interface (no copy)."""

    __slots__ = ("__array_interface__",)


_DOUBLE_P = ctypes.POINTER(ctypes.c_double)
_BOOL_P = ctypes.POINTER(ctypes.c_bool)
_SIZE_T = np.dtype(np.uintp).str


def _view(pointer, shape: tuple[int, ...], typestr: str) -> np.ndarray:
    """A numpy view of ``shape`` items of type ``typestr`` at a ctypes pointer."""
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    if not address or shape[0] == 0:
        return np.zeros(shape, dtype=typestr)
    buffer = _Buffer()
    buffer.__array_interface__ = {
        "data": (address, True),
        "shape": shape,
        "typestr": typestr,
        "version": 3,
    }
    return np.asarray(buffer)


_local = threading.local()


def _search(rcut: float) -> NeighborSearch:
    """This thread's cached search object for ``rcut``."""
    search = getattr(_local, "search", None)
    if search is None or search.rcut != float(rcut):
        search = NeighborSearch(rcut)
        _local.search = search
    return search


def neighbor_pairs(coord: np.ndarray, box: np.ndarray | None, rcut: float) -> Pairs:
    """Full (both directions) neighbour pairs of one frame.

    ``box`` holds the cell vectors as rows, or is ``None`` for a non-periodic frame. Cells
    shorter than 2·rcut are handled: one atom may see several images of the same neighbour
    and its own images.
    """
    return _search(rcut).pairs(coord, box)


def build_nlist(
    coord: np.ndarray,
    box: np.ndarray | None,
    atype: np.ndarray,
    rcut: float,
    sel: list[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-type padded neighbour list of one frame, DeePMD layout.

    Returns ``nlist`` (natoms, sum(sel)) int64 with -1 in padded slots, ``shift`` (natoms,
    sum(sel), 3) int64 image shifts (0 in padded slots), and ``counts`` (natoms, ntypes), the
    number of neighbours of each type found within rcut before truncation to ``sel``. Slots
    are laid out as [type 0 block (sel[0]) | type 1 block | ...], nearest first in a block.
    """
    atype = np.asarray(atype, dtype=np.int64)
    pairs = frame_pairs(coord, box, rcut)
    group = pairs.i * len(sel) + atype[pairs.j]
    return padded_lists(pairs, group, pair_order(pairs, group), len(atype), list(sel))


def frame_pairs(coord: np.ndarray, box: np.ndarray | None, rcut: float) -> Pairs:
    """`neighbor_pairs` for a caller that is done with them before this thread's next
    search: views of the library's buffers where it can (no copy)."""
    i, j, shift, dist = _search(rcut).compute(coord, box, full=True, shifts=True, copy=False)
    return Pairs(i=i, j=j, shift=shift, dist=dist)
