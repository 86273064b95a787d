"""Mixed-type systems (DeePMD's ``deepmd/npy/mixed``, and its HDF5 form): frames of one atom
count whose atom types change from frame to frame.

Layout: ``set.*/real_atom_types.npy`` holds the types of every frame, ``[nframes, natoms]``,
indexing ``type_map.raw``; ``type.raw`` only fixes the atom count (dpdata writes zeros);
type ``-1`` marks a virtual atom that pads a frame to the common count (its coordinates and
forces are ignored). Every set of the system must hold ``real_atom_types.npy``.

mdtrain's models take one composition per batch, so a mixed-type system is presented as one
`System` per *composition* (the number of atoms of each type): its frames are the frames
with those counts, in file order, and its atoms the real ones of each frame, sorted by type
(stable), so that every frame has the same type vector whatever order its file gives. Frames
stay on disk: a composition reads its rows of the shared arrays on request. Opening reads
``real_atom_types`` once (integers, natoms per frame) to group the frames; a composition keeps
each frame's atom order only when its frames differ in it (int32, real atoms per frame).
"""

from __future__ import annotations

import math

import numpy as np

from mdtrain.data.hdf5 import H5Store
from mdtrain.data.npy import Listing, NpyStore
from mdtrain.data.stores import open_store
from mdtrain.data.system import MixedTypeFound, SetInfo, System
from mdtrain.errors import MDTrainError

REAL_TYPES = "real_atom_types"
# arrays with values per frame; every other array (coord, force, atom_ener, atom_pref, drdq,
# aparam, ...) has values per atom slot, which a composition takes for its real atoms
_PER_FRAME = frozenset({"box", "energy", "virial", "fparam", "dipole", "polarizability"})


def open_systems(
    path: str,
    type_map: list[str] | None = None,
    outputs: dict | None = None,
    positions_only: bool = False,
    listing: Listing | None = None,
) -> list[System]:
    """The systems stored at ``path``: one `System`, or one per composition of a mixed-type
    system (see the module doc); ``outputs``: the label files of the model's outputs
    (`mdtrain.data.labels.output_labels`); ``positions_only``: see `System` (a mixed-type
    system's compositions are checked whole); ``listing``: see `open_store`."""
    store = open_store(path, not positions_only, listing)
    try:
        return [System(store, type_map, outputs, positions_only)]
    except MixedTypeFound:
        return MixedSystem(store).compositions(type_map, outputs)


def open_all(
    paths: list[str],
    type_map: list[str] | None = None,
    outputs: dict | None = None,
    positions_only: bool = False,
    listings: dict[str, Listing] | None = None,
) -> list[System]:
    """`open_systems` of every path, in order, as one list; ``listings``: the folders'
    entries that `expand_systems` gave (each used once: see `open_store`)."""
    if not listings:
        return [s for path in paths for s in open_systems(path, type_map, outputs, positions_only)]
    return [s for path in paths for s in open_systems(path, type_map, outputs, positions_only,
                                                      listings.pop(path, None))]  # fmt: skip


class MixedSystem:
    """A mixed-type system as stored: its sets, checked, before it is split by composition."""

    def __init__(self, store: NpyStore | H5Store):
        self.store = store
        self.path = store.path
        types = store.types()
        if types is None:
            raise MDTrainError(f"system {self.path}: type.raw is missing")
        self.natoms = int(types.size)
        if self.natoms == 0:
            raise MDTrainError(f"system {self.path}: type.raw is empty")
        self.type_map = store.type_map()
        self.headers = _Headers(store)
        self.sets = self._scan()
        self.nframes = sum(s.nframes for s in self.sets)

    def _scan(self) -> list[SetInfo]:
        sets, start = [], 0
        names = self.store.set_names()
        for name in names:
            where = self.store.where(name, REAL_TYPES + ".npy")
            header = self.headers.get(name, REAL_TYPES)
            if header is None:
                raise MDTrainError(
                    f"{where}: missing, but {names[0]} has one (every set of a mixed-type "
                    "system needs it)"
                )
            shape, dtype = header
            if dtype.kind not in "iuf":
                raise MDTrainError(f"{where}: expected integers, found dtype {dtype}")
            if len(shape) == 0 or math.prod(shape[1:]) != self.natoms:
                raise MDTrainError(
                    f"{where}: shape {list(shape)} does not match [nframes, {self.natoms}] "
                    f"({self.natoms} atoms in type.raw)"
                )
            coord = self.headers.get(name, "coord")
            if coord is None:
                raise MDTrainError(f"{self.store.where(name, 'coord.npy')}: missing")
            if coord[0] and coord[0][0] != shape[0]:
                raise MDTrainError(f"{where}: {shape[0]} frames but coord.npy has {coord[0][0]}")
            sets.append(SetInfo(name, start, int(shape[0])))
            start += int(shape[0])
        return sets

    def _limit(self, type_map: list[str] | None) -> tuple[int, str]:
        """How many types ``real_atom_types`` may index, and what names them."""
        if self.type_map is not None:
            return len(self.type_map), "type_map.raw names"
        if type_map:
            return len(type_map), "type_map has (and there is no type_map.raw)"
        raise MDTrainError(
            f"system {self.path}: a mixed-type system needs type_map.raw (or a model type_map)"
        )

    def _types(self, info: SetInfo, limit: int, names: str) -> np.ndarray:
        """The checked types of one set, (nframes, natoms) int64."""
        where = self.store.where(info.name, REAL_TYPES + ".npy")
        everything = np.arange(info.nframes)
        raw = np.asarray(self.store.rows(info.name, REAL_TYPES, everything))
        raw = raw.reshape(info.nframes, -1)
        types = raw.astype(np.int64)
        if raw.dtype.kind == "f":
            odd = np.flatnonzero((types != raw).any(axis=1))
            if len(odd):
                raise MDTrainError(f"{where}: frame {odd[0]} holds a type that is not an integer")
        bad = np.flatnonzero(((types < -1) | (types >= limit)).any(axis=1))
        if len(bad):
            row = types[bad[0]]
            value = int(row[(row < -1) | (row >= limit)][0])
            raise MDTrainError(
                f"{where}: frame {bad[0]} has type {value}, but {names} {limit} types "
                f"(0..{limit - 1}; -1 marks a virtual atom)"
            )
        empty = np.flatnonzero((types < 0).all(axis=1))
        if len(empty):
            raise MDTrainError(f"{where}: frame {empty[0]} has no real atom (every type is -1)")
        return types

    def compositions(
        self, type_map: list[str] | None = None, outputs: dict | None = None
    ) -> list[System]:
        """One `System` per composition (the number of atoms of each type), in the order of
        their first frames."""
        per_frame = _PER_FRAME | {k for k, (_, atomic) in (outputs or {}).items() if not atomic}
        limit, names = self._limit(type_map)
        found: dict[bytes, _Composition] = {}
        for info in self.sets:
            types = self._types(info, limit, names)
            real = types >= 0
            frame = np.arange(len(types))[:, None]
            counts = np.bincount((frame * limit + types)[real], minlength=len(types) * limit)
            counts = counts.reshape(len(types), limit)
            # each frame's real atoms sorted by type (stable), virtual ones last
            order = np.argsort(np.where(real, types, limit), axis=1, kind="stable")
            unique, inverse = np.unique(counts, axis=0, return_inverse=True)
            inverse = inverse.reshape(-1)
            for u, row in enumerate(unique):
                frames = np.flatnonzero(inverse == u)
                group = found.setdefault(row.tobytes(), _Composition(row, info.start + frames[0]))
                group.add(info.name, frames, order[frames, : int(row.sum())])
        own = self.type_map or list(type_map)
        systems = []
        for group in sorted(found.values(), key=lambda g: g.first):
            label = "".join(f"{own[t]}{n}" for t, n in enumerate(group.counts.tolist()) if n)
            store = CompositionStore(self, group, label, per_frame)
            systems.append(System(store, type_map, outputs))
        return systems


class _Composition:
    """Where the frames of one composition lie: per set, their rows and each frame's real
    atoms sorted by type (one row when every frame orders its atoms alike)."""

    def __init__(self, counts: np.ndarray, first: int):
        self.counts = counts
        self.first = int(first)
        self.rows: dict[str, np.ndarray] = {}
        self.atoms: dict[str, np.ndarray] = {}

    def add(self, set_name: str, rows: np.ndarray, atoms: np.ndarray) -> None:
        self.rows[set_name] = rows
        same = (atoms == atoms[0]).all()
        self.atoms[set_name] = atoms[:1] if same else atoms.astype(np.int32)


class _Headers:
    """Array headers of a store, read once for all the compositions that share them."""

    def __init__(self, store: NpyStore | H5Store):
        self.store = store
        self.cache: dict[tuple[str, str], tuple | None] = {}

    def get(self, set_name: str, name: str) -> tuple[tuple[int, ...], np.dtype] | None:
        key = (set_name, name)
        if key not in self.cache:
            self.cache[key] = self.store.header(set_name, name)
        return self.cache[key]


class CompositionStore:
    """The frames of one composition of a mixed-type system, as a store a `System` reads:
    its rows of each set, its real atoms only, sorted by type in every frame. Its atoms
    change from frame to frame in the files: no atomic tensor of ``sel_type`` atoms only."""

    fixed_atoms = False

    def __init__(
        self,
        parent: MixedSystem,
        group: _Composition,
        label: str,
        per_frame: frozenset[str] = _PER_FRAME,
    ):
        self._parent = parent.store
        self._per_frame = per_frame
        self._headers = parent.headers
        self._types = np.repeat(np.arange(len(group.counts)), group.counts)
        self._natoms = parent.natoms  # virtual atoms included, as stored
        self._rows = group.rows
        self._atoms = group.atoms
        self._sets = [s.name for s in parent.sets if s.name in group.rows]
        self._starts = {s.name: s.start for s in parent.sets}
        self.kind = parent.store.kind
        self.source = parent.path
        self.path = f"{parent.path}[{label}]"

    def where(self, set_name: str | None = None, name: str | None = None) -> str:
        """A file path for error messages: the shared file's."""
        return self._parent.where(set_name, name)

    def types(self) -> np.ndarray:
        return self._types.copy()

    def type_map(self) -> list[str] | None:
        return self._parent.type_map()

    def nopbc(self) -> bool:
        return self._parent.nopbc()

    def set_names(self) -> list[str]:
        return list(self._sets)

    def header(self, set_name: str, name: str) -> tuple[tuple[int, ...], np.dtype] | None:
        """The shape a composition's array has: its frames, its real atoms."""
        if name == REAL_TYPES:
            return None
        header = self._headers.get(set_name, name)
        if header is None:
            return None
        shape, dtype = header
        count = len(self._rows[set_name])
        if name in self._per_frame or len(shape) == 0:
            return (count, *shape[1:]), dtype
        values = math.prod(shape[1:])
        if values == 0 or values % self._natoms:
            width = "3·" if name in ("coord", "force") else "k·"
            raise MDTrainError(
                f"{self.where(set_name, name + '.npy')}: shape {list(shape)} does not match "
                f"[nframes, {width}{self._natoms}] ({self._natoms} atoms in type.raw)"
            )
        return (count, values // self._natoms * len(self._types)), dtype

    def rows(self, set_name: str, name: str, rows: np.ndarray) -> np.ndarray:
        """Frames ``rows`` of this composition (sorted, unique), its real atoms only."""
        data = self._parent.rows(set_name, name, self._rows[set_name][rows])
        if name in self._per_frame or data.ndim < 2:
            return data
        data = data.reshape(len(rows), self._natoms, -1)
        atoms = self._atoms[set_name]
        if len(atoms) == 1:
            data = data[:, atoms[0]]
        else:
            data = np.take_along_axis(data, atoms[rows][:, :, None].astype(np.intp), axis=1)
        return data.reshape(len(rows), -1)

    def array(self, set_name: str, name: str) -> np.ndarray:
        return self.rows(set_name, name, np.arange(len(self._rows[set_name])))

    def source_frames(self, set_name: str, rows: np.ndarray) -> np.ndarray:
        """Frame numbers in the shared files (over all sets) of this composition's ``rows``
        of ``set_name``."""
        return self._rows[set_name][rows] + self._starts[set_name]
