"""One training system: fixed atoms and types, frames read lazily from deepmd/npy or deepmd/hdf5.

Opening a system reads only ``type.raw``, ``type_map.raw``, ``nopbc`` and the array headers,
and checks shapes; frames are read on request. Atom types are remapped by element name to the
model's ``type_map`` and atoms are sorted by type (stable), the same rule as DeePMD, so every
array handed out is in that order; ``atom_order`` maps it back to the file's order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from mdtrain.data.hdf5 import H5Store
from mdtrain.data.identity import content_digest
from mdtrain.data.labels import (  # noqa: F401 (LABELS ... PARAMS: imported from here too)
    ATOMIC_TENSORS,
    EXTRA_LABELS,
    FREE_WIDTH,
    LABELS,
    LAYOUT,
    PARAMS,
    TENSOR_LABELS,
    scatter_selected,
)
from mdtrain.data.npy import NpyStore, row_bounds
from mdtrain.data.stores import open_store
from mdtrain.data.types import read_atom_types
from mdtrain.errors import MDTrainError

_ARRAYS = ("box", *LABELS, *EXTRA_LABELS, *TENSOR_LABELS, *PARAMS)  # besides coord


class MixedTypeFound(MDTrainError):
    """Raised by `System` on a mixed-type system, which ``mdtrain.data.mixed`` opens."""


@dataclass(frozen=True)
class SetInfo:
    """One ``set.*`` directory: its frames are ``start .. start + nframes - 1`` of the system."""

    name: str
    start: int
    nframes: int


def open_system(
    path: str, type_map: list[str] | None = None, outputs: dict | None = None
) -> System:
    """Open a deepmd/npy directory, ``file.h5#/group``, or an HDF5 file whose root is a system;
    ``outputs``: the label files of the model's outputs (`mdtrain.data.labels.output_labels`).

    A mixed-type system (``set.*/real_atom_types.npy``) holds frames of several compositions:
    open it with ``mdtrain.data.open_systems``, which gives one `System` per composition."""
    return System(open_store(path), type_map, outputs)


class System:
    """A read-only view of one system; see docs/developer.md (``mdtrain.data``)."""

    def __init__(
        self,
        store: NpyStore | H5Store,
        type_map: list[str] | None = None,
        outputs: dict[str, tuple[int, bool]] | None = None,
        positions_only: bool = False,
    ):
        """``outputs``: label files of the model's outputs beyond the fixed ones (DOS,
        properties): name -> (values per frame or per atom, per atom); an `OutputLabels`'
        ``sel_type``: atomic tensor files may hold those atoms only. ``positions_only``:
        read and check the coordinates and cells now (what a neighbour search needs), the
        label files when `labels` is first asked (``neighbor-stat`` never asks)."""
        self._store = store
        self._outputs = dict(outputs or {})
        self._layout = {**LAYOUT, **self._outputs} if self._outputs else LAYOUT  # not changed
        self.path: str = store.path
        # the system as the input names it: a mixed-type system's compositions share it
        self.source: str = getattr(store, "source", store.path)
        self.type_map = list(type_map) if type_map else None
        names = store.set_names()
        absent = getattr(store, "absent", None)  # one existence check, not a failed read
        mixed = names and not (absent and absent(names[0], "real_atom_types"))
        if mixed and store.header(names[0], "real_atom_types") is not None:
            # before type.raw is read: a mixed-type system's type.raw holds placeholders
            raise MixedTypeFound(
                f"system {self.path}: mixed-type (set.*/real_atom_types.npy): open it with "
                "mdtrain.data.open_systems"
            )
        types = read_atom_types(self.path, store, self.type_map)
        self._own_types, self._own_map = types.own, types.own_map
        self.natoms = len(types.model_types)
        model_types, self.elements = types.model_types, list(types.elements)
        self.atom_order, self.atype = types.atom_order.copy(), types.atype.copy()
        self._reorder = types.reordered
        sel = getattr(outputs, "sel_type", None)  # a mixed-type composition: all atoms only
        self._selected = None if sel is None or not getattr(store, "fixed_atoms", True) else (
            np.isin(np.asarray(model_types), sel))  # fmt: skip
        self._nsel = -1 if self._selected is None else int(self._selected.sum())
        self._sel_layout: set[tuple[str, str]] = set()  # (set, array) of those atoms only
        self.periodic = not store.nopbc()
        self._widths: dict[str, int] = {}
        self._reshaped: set[tuple[str, str]] = set()  # (set, array) read as (nframes, -1)
        self._labels: frozenset[str] | None = None
        self.sets, labels = self._scan_sets(names, ("box",) if positions_only else None)
        if not positions_only:
            self._labels = labels
        self.nframes = sum(s.nframes for s in self.sets)
        if self.nframes == 0:
            raise MDTrainError(f"system {self.path}: has no frames (every set.* is empty)")
        self._starts = np.array([s.start for s in self.sets], dtype=np.int64)

    def __repr__(self) -> str:
        return f"System({self.path!r}, natoms={self.natoms}, nframes={self.nframes})"

    @property
    def store(self) -> NpyStore | H5Store:
        """The storage behind the system, for copying its arrays as they are (packing)."""
        return self._store

    def __len__(self) -> int:
        return self.nframes

    @property
    def labels(self) -> frozenset[str]:
        """The labels every frame has (``energy``, ``force``, ... , ``fparam``)."""
        if self._labels is None:  # opened for positions only: the label files checked now
            self._labels = self._scan_sets([s.name for s in self.sets])[1]
        return self._labels

    # -- layout checks ----------------------------------------------------------------------

    def _nframes_of(self, set_name: str, name: str, nframes: int = 0) -> int | None:
        """Frame count of one array from its header, after checking its shape. A parameter
        file of another shape holding ``nframes`` rows in all is read as DeePMD-kit reads it,
        reshaped to (nframes, -1) (DeePMD-kit's fparam example stores aparam as (1, ...))."""
        header = self._store.header(set_name, name)
        if header is None:
            return None
        shape, dtype = header
        if name in PARAMS and nframes and shape[:1] != (nframes,):
            size = math.prod(shape)
            if size % nframes == 0:
                shape = (nframes, size // nframes)
                self._reshaped.add((set_name, name))
        if dtype.kind not in "fiu":
            where = self._store.where(set_name, name + ".npy")
            raise MDTrainError(f"{where}: expected numbers, found dtype {dtype}")
        width, per_atom = self._layout[name]
        expected = width * self.natoms if per_atom else width
        if name in FREE_WIDTH:  # checked against the model (or the loss) by their users
            return self._free_width(name, shape, self._store.where(set_name, name + ".npy"),
                                    per_atom)  # fmt: skip
        values = math.prod(shape[1:]) if len(shape) else -1
        nsel = -1 if self._selected is None or name not in ATOMIC_TENSORS else self._nsel
        if values == width * nsel != expected:
            self._sel_layout.add((set_name, name))
        elif values != expected:
            where = self._store.where(set_name, name + ".npy")
            unit = f" ({self.natoms} atoms in type.raw)" if per_atom else ""
            if nsel >= 0:
                unit += f" or [nframes, {width * nsel}] (its {nsel} atoms of sel_type)"
            what = f" (the model's {name}: {width} per {'atom' if per_atom else 'frame'})"
            raise MDTrainError(
                f"{where}: shape {list(shape)} does not match [nframes, {expected}]{unit}"
                + (what if name in self._outputs else "")
            )
        return int(shape[0])

    def _plain_frames(self, set_name: str, name: str, nframes: int = 0) -> int | None:
        """`_nframes_of` of ``coord`` or ``box`` (fixed widths), the common case checked in
        a few steps (thousands of small systems): anything else by `_nframes_of`."""
        header = self._store.header(set_name, name)
        if header is not None:
            shape, dtype = header
            width, per_atom = LAYOUT[name]
            expected = width * self.natoms if per_atom else width
            if len(shape) == 2 and shape[1] == expected and dtype.kind in "fiu":
                return shape[0]
        return self._nframes_of(set_name, name)

    def _free_width(self, name: str, shape: tuple, where: str, per_atom: bool) -> int:
        """Frame count of an array whose width per frame (or atom) the first set sets."""
        step, unit = FREE_WIDTH[name]
        atoms = self.natoms if per_atom else 1
        values = math.prod(shape[1:]) if len(shape) else 0
        if values == 0 or values % (step * atoms):
            count = f"{self.natoms} atoms " if per_atom else ""
            raise MDTrainError(
                f"{where}: shape {list(shape)} does not match [nframes, {count}{unit}]"
            )
        known = self._widths.get(name)
        if known and values != known:
            raise MDTrainError(
                f"{where}: {values // atoms} values per {'atom' if per_atom else 'frame'}, "
                f"but an earlier set has {known // atoms}"
            )
        self._widths[name] = values
        return int(shape[0])

    def _scan_sets(
        self, names: list[str], only: tuple[str, ...] | None = None
    ) -> tuple[list[SetInfo], frozenset[str]]:
        """Each set's frames, checked across its arrays (``only``: these besides ``coord``),
        and the labels that every set holds."""
        if not names:
            raise MDTrainError(f"system {self.path}: no set.* directories (no frames)")
        sets: list[SetInfo] = []
        labels: frozenset[str] | None = None
        start = 0
        frames_of = self._nframes_of if only is None else self._plain_frames
        for set_name in names:
            nf = frames_of(set_name, "coord")
            if nf is None:
                raise MDTrainError(f"{self._store.where(set_name, 'coord.npy')}: missing")
            present = set()
            listed = getattr(self._store, "listed_arrays", None)  # a few: asked straight away
            listed = None if listed is None or only is not None else listed(set_name)
            arrays = (*_ARRAYS, *self._outputs) if only is None else only
            for name in arrays if listed is None else [n for n in arrays if n in listed]:
                count = frames_of(set_name, name, nf)
                if count is None:
                    continue
                if count != nf:
                    raise MDTrainError(
                        f"{self._store.where(set_name, name + '.npy')}: {count} frames but "
                        f"coord.npy has {nf}"
                    )
                present.add(name)
            if self.periodic and "box" not in present:
                raise MDTrainError(
                    f"{self._store.where(set_name, 'box.npy')}: missing in a periodic system "
                    "(add an empty 'nopbc' file if the system is not periodic)"
                )
            here = frozenset(present - {"box"})
            if labels is None:
                labels, first = here, set_name
            elif here != labels:
                extra = sorted(here ^ labels)[0]
                has, lacks = (set_name, first) if extra in here else (first, set_name)
                raise MDTrainError(
                    f"system {self.path}: {has} has {extra}.npy but {lacks} does not "
                    "(every set must hold the same labels)"
                )
            sets.append(SetInfo(set_name, start, nf))
            start += nf
        return sets, labels or frozenset()

    # -- frames -----------------------------------------------------------------------------

    def has(self, label: str) -> bool:
        """True when every frame has ``label`` (``energy``, ``force``, ``virial`` or one of
        `EXTRA_LABELS`, `TENSOR_LABELS`, `PARAMS`)."""
        return label in self.labels

    def _read(self, set_info: SetInfo, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of one array as float64 (n, values per frame), all atoms."""
        data = np.asarray(self.stored_rows(set_info, name, rows), dtype=np.float64)
        if (set_info.name, name) in self._sel_layout:
            return scatter_selected(data, self._selected, self._layout[name][0])
        return data

    def stored_rows(self, set_info: SetInfo, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (sorted, unique) of one array of a set as stored, (n, values per
        frame), in the file's atom order and dtype."""
        if (set_info.name, name) in self._reshaped:
            whole = self._store.array(set_info.name, name)
            return np.asarray(whole).reshape(set_info.nframes, -1)[rows]
        return np.asarray(self._store.rows(set_info.name, name, rows)).reshape(len(rows), -1)

    def frames(
        self, indices, labels: Iterable[str] | None = None, positions: bool = True
    ) -> dict[str, np.ndarray]:
        """Frames ``indices`` (global over sets, in the given order, repeats allowed), with
        the labels named in ``labels`` that the system has (default: all it has; ``()``:
        positions and cells only, as neighbour searches need, without reading the rest);
        ``positions=False`` leaves out ``coord`` and ``box`` (the energy bias needs
        energies only)."""
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        if index.size:
            low, high = row_bounds(index)
            if low < -self.nframes or high >= self.nframes:
                raise IndexError(f"{self.path}: frame index out of range 0..{self.nframes - 1}")
            if low < 0:
                index = np.where(index < 0, index + self.nframes, index)
        n, natoms = len(index), self.natoms
        found = None if labels is None or labels or not positions else self._kept_positions(index)
        if found is not None:  # every frame's positions, as the neighbour statistics ask
            return found
        if labels is None:
            wanted = self.labels
        else:
            asked = set(labels)
            wanted = self.labels & asked if asked else frozenset()  # (): no label files
        where = (["coord"] + (["box"] if self.periodic else [])) if positions else []
        names = where + sorted(wanted)
        out = self._gather(index, names)
        order = self.atom_order if self._reorder else slice(None)
        result = {}
        if positions:
            result["coord"] = out["coord"].reshape(n, natoms, 3)[:, order]
        if positions and self.periodic:
            result["box"] = out["box"].reshape(n, 3, 3)
        if not wanted:  # positions only (neighbour searches): nothing more to sort out
            return result
        if "energy" in out:
            result["energy"] = out["energy"][:, 0]
        if "force" in out:
            result["force"] = out["force"].reshape(n, natoms, 3)[:, order]
        if "virial" in out:
            result["virial"] = out["virial"].reshape(n, 3, 3)
        for name in EXTRA_LABELS:  # per atom: (n, natoms), or (n, natoms, 3 x ncoord)
            if name in out:
                per_atom = out[name].reshape(n, natoms, -1)[:, order]
                result[name] = per_atom[:, :, 0] if per_atom.shape[2] == 1 else per_atom
        for name in TENSOR_LABELS:  # (n, 3 or 9), atomic ones (n, natoms, 3 or 9)
            if name in out:
                atomic = name.startswith("atomic_")
                result[name] = out[name].reshape(n, natoms, -1)[:, order] if atomic else out[name]
        for name, (_, per_atom) in self._outputs.items():  # (n, k); atomic (n, natoms, k)
            if name in out:
                result[name] = out[name].reshape(n, natoms, -1)[:, order] if per_atom else out[name]
        if "fparam" in out:
            result["fparam"] = out["fparam"]
        if "aparam" in out:  # (n, natoms, numb_aparam) in the model's atom order
            result["aparam"] = out["aparam"].reshape(n, natoms, -1)[:, order]
        return result

    def _kept_positions(self, index: np.ndarray) -> dict[str, np.ndarray] | None:
        """``frames(index, labels=())`` when ``index`` is every frame in order, of one set
        whose arrays the store kept (thousands of small systems): a few numpy calls instead
        of the general gather. None otherwise."""
        kept, n, name = getattr(self._store, "kept", None), len(index), self.sets[0].name
        if kept is None or len(self.sets) != 1 or n != self.nframes or n > 64:
            return None
        coord, box = kept(name, "coord"), kept(name, "box") if self.periodic else None
        if coord is None or (box is None and self.periodic) or index.tolist() != [*range(n)]:
            return None
        coord = coord.reshape(n, self.natoms, 3)
        coord = coord.take(self.atom_order, axis=1) if self._reorder else coord.copy()
        result = {"coord": coord.astype(np.float64, copy=False)}
        if self.periodic:
            result["box"] = np.array(box, dtype=np.float64).reshape(n, 3, 3)
        return result

    def _gather(self, index: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
        """Rows ``index`` (global, non-negative) of the arrays ``names``, float64 (n, values
        per frame), fresh arrays. A run of consecutive frames of one set (the usual ask) is
        read as it is; any other set of frames row by row of each set touched."""
        n = len(index)
        if n:
            first = int(index[0])
            s = 0 if len(self.sets) == 1 else int(np.searchsorted(self._starts, first, "right")) - 1
            info = self.sets[s]
            run = int(index[-1]) - first == n - 1 and (n < 3 or bool((np.diff(index) > 0).all()))
            if run and first + n <= info.start + info.nframes:
                rows = np.arange(first - info.start, first - info.start + n)
                return {name: self._read(info, name, rows) for name in names}
        out = {name: np.empty((n, self._width(name))) for name in names}
        which = np.searchsorted(self._starts, index, side="right") - 1
        for s in np.unique(which):
            set_info = self.sets[s]
            mask = which == s
            rows, inverse = np.unique(index[mask] - set_info.start, return_inverse=True)
            for name in names:
                out[name][mask] = self._read(set_info, name, rows)[inverse]
        return out

    def values_per_atom(self, name: str) -> int:
        """Values per atom and frame of a per-atom label (``drdq``: 3 x numb_generalized_coord;
        ``aparam``: numb_aparam)."""
        return self._width(name) // self.natoms

    def values_per_frame(self, name: str) -> int:
        """Values per frame of an array (``fparam``: numb_fparam); 0 when absent."""
        return self._widths.get(name, 0) if name in FREE_WIDTH else self._width(name)

    def source_frames(self, set_info: SetInfo, rows: np.ndarray) -> np.ndarray:
        """Frame numbers in the files of rows ``rows`` of a set: the frames' own numbers,
        except for a composition of a mixed-type system (numbered within the shared files)."""
        source_frames = getattr(self._store, "source_frames", None)
        if source_frames is None:
            return rows + set_info.start
        return source_frames(set_info.name, rows)

    def _width(self, name: str) -> int:
        if name in FREE_WIDTH:
            return self._widths.get(name, 0)
        width, per_atom = self._layout[name]
        return width * self.natoms if per_atom else width

    def fingerprint(self) -> dict:
        """Path, sizes and a SHA-256 of types, coordinates and cells (`content_digest`)."""
        digest = content_digest(self._own_types, self._own_map, self.periodic, self.sets,
                                self._width, self._store)  # fmt: skip
        return {"path": self.path, "nframes": self.nframes, "natoms": self.natoms,
                "sha256": digest}  # fmt: skip
