"""Test data the project makes itself: water-like frames, pair-potential labels, system writers.

``random_water_like`` places H2O-like molecules on a jittered grid (never overlapping) in a
cubic or triclinic cell; ``lj_labels`` gives physically consistent energies, forces and virials
from a smooth pair potential, so a model can learn them. Writers lay the arrays out as
deepmd/npy or deepmd/hdf5 with plain numpy/h5py, independently of ``mdtrain.data``.

Virial convention (DeePMD's): ``W = -dE/dε`` for the homogeneous strain ``r → r(1+ε)``
applied to positions and cell together, in eV. For a pair potential this is
``W_ab = -Σ_pairs φ'(d) d_a d_b / d`` with ``d = r_j - r_i`` (nearest image), equal to
``Σ_i F_i ⊗ r_i`` over the atoms and their periodic images. ASE's stress is ``σ = -W / V``.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

TYPE_MAP = ["O", "H"]
_OH = 0.9572  # Å
_HOH = np.deg2rad(104.52)


# -- geometry -------------------------------------------------------------------------------


def random_water_like(
    nframes: int,
    nmol: int,
    box_len: float,
    seed: int = 0,
    triclinic: bool = False,
    jitter: float = 0.08,
    min_dist: float = 1.5,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random non-overlapping H2O-like frames.

    Returns ``coords (nframes, 3·nmol, 3)``, ``types (3·nmol,)`` with O = 0 and H = 1 in the
    order O H H O H H ... (not sorted by type, on purpose), and ``boxes (nframes, 3, 3)``
    (rows are cell vectors; tilted when ``triclinic``). Oxygens sit on a grid of spacing
    ``box_len / ceil(nmol^(1/3))`` (at least 2.6 Å, else ValueError) moved by up to
    ``jitter`` of the spacing; each molecule has a random orientation and O-H ≈ 0.96 Å, and
    atoms of different molecules stay at least ``min_dist`` apart (orientations redrawn).
    """
    rng = np.random.default_rng(seed)
    per_side = int(np.ceil(nmol ** (1 / 3) - 1e-9))
    spacing = box_len / per_side
    if spacing < 2.6:
        raise ValueError(
            f"{nmol} molecules do not fit in a {box_len} Å box (spacing {spacing:.2f} Å)"
        )
    cell = np.eye(3) * box_len
    if triclinic:
        cell[1, 0] = 0.2 * box_len
        cell[2, 0] = -0.1 * box_len
        cell[2, 1] = 0.15 * box_len
    grid = np.stack(np.meshgrid(*[np.arange(per_side)] * 3, indexing="ij"), -1).reshape(-1, 3)
    local = np.array(
        [[0.0, 0.0, 0.0], [_OH, 0.0, 0.0], [_OH * np.cos(_HOH), _OH * np.sin(_HOH), 0.0]]
    )
    coords = np.empty((nframes, 3 * nmol, 3))
    for f in range(nframes):
        sites = grid[rng.permutation(len(grid))[:nmol]]
        frac = (sites + 0.5 + rng.uniform(-jitter, jitter, size=(nmol, 3))) / per_side
        oxygens = frac @ cell
        redraw = np.arange(nmol)
        for _ in range(200):
            bonds = local * (1.0 + rng.uniform(-0.03, 0.03, size=(len(redraw), 3, 1)))
            placed = oxygens[redraw, None] + bonds @ _random_rotations(rng, len(redraw))
            coords[f].reshape(nmol, 3, 3)[redraw] = placed
            redraw = _crowded_molecules(coords[f], cell, min_dist)
            if not len(redraw):
                break
        else:
            raise ValueError(f"cannot place {nmol} molecules {min_dist} Å apart in {box_len} Å")
    types = np.tile([0, 1, 1], nmol).astype(np.int64)
    boxes = np.repeat(cell[None], nframes, axis=0)
    return coords, types, boxes


def _crowded_molecules(coord: np.ndarray, cell: np.ndarray, min_dist: float) -> np.ndarray:
    """Molecules with an atom closer than ``min_dist`` to an atom of another molecule."""
    from ase import Atoms
    from vesin import ase_neighbor_list as neighbor_list

    atoms = Atoms(positions=coord, cell=cell, pbc=True)
    i, j = neighbor_list("ij", atoms, min_dist)
    other = i // 3 != j // 3
    return np.unique(i[other] // 3)


def _random_rotations(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` uniformly random proper rotation matrices (n, 3, 3)."""
    q, r = np.linalg.qr(rng.normal(size=(n, 3, 3)))
    q = q * np.sign(np.diagonal(r, axis1=1, axis2=2))[:, None, :]
    q[np.linalg.det(q) < 0, :, 0] *= -1
    return q


# -- labels ---------------------------------------------------------------------------------


def default_pair_params(ntypes: int) -> dict[str, np.ndarray]:
    """Morse parameters per type pair: well depth ε (eV), minimum r0 (Å), stiffness ρ0."""
    radius = np.array([1.45, 0.5] + [1.0] * max(ntypes - 2, 0))[:ntypes]
    depth = np.array([0.1, 0.03] + [0.05] * max(ntypes - 2, 0))[:ntypes]
    return {
        "epsilon": np.sqrt(np.outer(depth, depth)),
        "r0": radius[:, None] + radius[None, :],
        "rho0": np.full((ntypes, ntypes), 3.0),
    }


def lj_labels(
    coords: np.ndarray,
    types: np.ndarray,
    boxes: np.ndarray | None,
    rcut: float,
    rcut_smth: float | None = None,
    params: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Energy (nf,), force (nf, N, 3) and virial (nf, 3, 3) of a smooth pair potential.

    The pair energy is ASE's Morse form ``ε e^{ρ0(1-d/r0)} (e^{ρ0(1-d/r0)} - 2)`` with
    parameters per type pair (``default_pair_params``), times ASE's quintic switch from
    ``rcut_smth`` (default ``rcut - 1``) to ``rcut``: smooth, bounded at short range, and
    for one type identical to ``ase.calculators.morse.MorsePotential``. (A Lennard-Jones
    12-6 form would blow up on the 0.96 Å O-H bonds; the name is kept for the callers.)
    Pairs come from vesin (fast; the tests check these labels against ASE's own
    ``MorsePotential`` and neighbour list, and against finite differences);
    ``boxes=None`` means non-periodic.
    """
    from ase import Atoms
    from vesin import ase_neighbor_list as neighbor_list

    types = np.asarray(types)
    ntypes = int(types.max()) + 1
    p = params or default_pair_params(ntypes)
    r_on = rcut - 1.0 if rcut_smth is None else rcut_smth
    nf, natoms = coords.shape[:2]
    energy = np.zeros(nf)
    force = np.zeros((nf, natoms, 3))
    virial = np.zeros((nf, 3, 3))
    for f in range(nf):
        periodic = boxes is not None
        atoms = Atoms(
            numbers=np.ones(natoms, dtype=int),
            positions=coords[f],
            cell=boxes[f] if periodic else np.zeros((3, 3)),
            pbc=periodic,
        )
        i, j, d, vec = neighbor_list("ijdD", atoms, rcut)
        ti, tj = types[i], types[j]
        eps, r0, rho = p["epsilon"][ti, tj], p["r0"][ti, tj], p["rho0"][ti, tj]
        expf = np.exp(rho * (1.0 - d / r0))
        pair = eps * expf * (expf - 2.0)
        dpair = (-2.0 * eps * rho / r0) * expf * (expf - 1.0)
        s, ds = _switch(d, r_on, rcut)
        # every unordered pair appears twice in the full list: halve
        energy[f] = 0.5 * np.sum(pair * s)
        de = 0.5 * (dpair * s + pair * ds)  # dE/dd per listed (i, j)
        grad = (de / d)[:, None] * vec  # dE/dr_j from this entry; -dE/dr_i
        for axis in range(3):
            force[f, :, axis] = np.bincount(i, grad[:, axis], natoms) - np.bincount(
                j, grad[:, axis], natoms
            )
        virial[f] = -(vec.T * (de / d)) @ vec
    return energy, force, virial


def _switch(d: np.ndarray, r_on: float, r_off: float) -> tuple[np.ndarray, np.ndarray]:
    """Quintic smoothstep from 1 at ``r_on`` to 0 at ``r_off`` and its derivative."""
    s = np.clip((r_off - d) / (r_off - r_on), 0.0, 1.0)
    inside = (s > 0.0) & (s < 1.0)
    value = 6 * s**5 - 15 * s**4 + 10 * s**3
    slope = -np.where(inside, 30 * s**4 - 60 * s**3 + 30 * s**2, 0.0) / (r_off - r_on)
    return value, slope


# -- writers --------------------------------------------------------------------------------


def _sets(nframes: int, set_size: int | None) -> list[tuple[str, slice]]:
    size = set_size or nframes
    return [
        (f"set.{k:03d}", slice(start, min(start + size, nframes)))
        for k, start in enumerate(range(0, nframes, size))
    ]


def _arrays(coords, boxes, energy, force, virial, real_types=None) -> dict[str, np.ndarray]:
    nf = len(coords)
    arrays = {"coord": np.asarray(coords, dtype=np.float64).reshape(nf, -1)}
    if real_types is not None:
        arrays["real_atom_types"] = np.asarray(real_types, dtype=np.int64).reshape(nf, -1)
    if boxes is not None:
        arrays["box"] = np.asarray(boxes, dtype=np.float64).reshape(nf, 9)
    if energy is not None:
        arrays["energy"] = np.asarray(energy, dtype=np.float64).reshape(nf)
    if force is not None:
        arrays["force"] = np.asarray(force, dtype=np.float64).reshape(nf, -1)
    if virial is not None:
        arrays["virial"] = np.asarray(virial, dtype=np.float64).reshape(nf, 9)
    return arrays


def write_npy_system(
    path,
    coords: np.ndarray,
    types: np.ndarray,
    type_map: list[str] | None = None,
    boxes: np.ndarray | None = None,
    energy: np.ndarray | None = None,
    force: np.ndarray | None = None,
    virial: np.ndarray | None = None,
    set_size: int | None = None,
    real_types: np.ndarray | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> str:
    """Write a deepmd/npy system directory; ``boxes=None`` writes ``nopbc``; ``real_types``
    (nframes, natoms) makes it mixed-type (``set.*/real_atom_types.npy``); ``extra`` more
    arrays by file name (``dipole``, ``atomic_dipole``, ...), one row per frame. Returns the
    path."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "type.raw"), "w") as handle:
        handle.write("\n".join(str(int(t)) for t in types) + "\n")
    if type_map is not None:
        with open(os.path.join(path, "type_map.raw"), "w") as handle:
            handle.write("\n".join(type_map) + "\n")
    if boxes is None:
        open(os.path.join(path, "nopbc"), "w").close()
    arrays = _arrays(coords, boxes, energy, force, virial, real_types)
    for name, values in (extra or {}).items():
        arrays[name] = np.asarray(values, dtype=np.float64).reshape(len(coords), -1)
    for set_name, rows in _sets(len(coords), set_size):
        os.makedirs(os.path.join(path, set_name), exist_ok=True)
        for name, values in arrays.items():
            np.save(os.path.join(path, set_name, name + ".npy"), values[rows])
    return path


def shuffled_copy(src, dst, order: np.ndarray) -> None:
    """The deepmd/npy system ``src`` copied to ``dst`` with its atoms in ``order``: type.raw,
    coordinates and the per-atom arrays (``atom_*``, ``atomic_*``) of set.000."""
    shutil.copytree(src, dst)
    types = np.loadtxt(os.path.join(src, "type.raw"), dtype=int)
    np.savetxt(os.path.join(dst, "type.raw"), types[order], fmt="%d")
    set_dir = os.path.join(dst, "set.000")
    for name in os.listdir(set_dir):
        stem = name.removesuffix(".npy")
        if stem == "coord" or stem.startswith(("atom_", "atomic_")):
            values = np.load(os.path.join(set_dir, name))
            nf = values.shape[0]
            values = values.reshape(nf, len(types), -1)[:, order].reshape(nf, -1)
            np.save(os.path.join(set_dir, name), values)


def write_hdf5_system(
    h5path,
    group: str,
    coords: np.ndarray,
    types: np.ndarray,
    type_map: list[str] | None = None,
    boxes: np.ndarray | None = None,
    energy: np.ndarray | None = None,
    force: np.ndarray | None = None,
    virial: np.ndarray | None = None,
    set_size: int | None = None,
    real_types: np.ndarray | None = None,
) -> str:
    """Write (append) a deepmd/hdf5 system as ``group`` of ``h5path`` (``real_types`` as in
    `write_npy_system`); returns ``file#/group``."""
    import h5py

    h5path = str(h5path)
    _close_cached(h5path)
    with h5py.File(h5path, "a") as handle:
        g = handle.require_group(group)
        g.create_dataset("type.raw", data=np.asarray(types, dtype=np.int64))
        if type_map is not None:
            g.create_dataset("type_map.raw", data=np.array(type_map, dtype="S"))
        if boxes is None:
            g.create_dataset("nopbc", data=True)
        arrays = _arrays(coords, boxes, energy, force, virial, real_types)
        for set_name, rows in _sets(len(coords), set_size):
            s = g.create_group(set_name)
            for name, values in arrays.items():
                s.create_dataset(name + ".npy", data=values[rows])
    return f"{h5path}#/{group.strip('/')}"


def _close_cached(h5path: str) -> None:
    """Let the writer open a file that mdtrain may hold open read-only in this process."""
    try:
        from mdtrain.data.hdf5 import close_h5
    except ImportError:
        return
    close_h5(h5path)


def water_labeled(
    nframes: int = 6,
    nmol: int = 8,
    box_len: float = 6.4,
    seed: int = 0,
    rcut: float = 4.0,
    triclinic: bool = False,
) -> dict:
    """A ready labelled water-like data set: keyword arguments for the writers."""
    coords, types, boxes = random_water_like(nframes, nmol, box_len, seed, triclinic)
    energy, force, virial = lj_labels(coords, types, boxes, rcut)
    return {
        "coords": coords,
        "types": types,
        "type_map": list(TYPE_MAP),
        "boxes": boxes,
        "energy": energy,
        "force": force,
        "virial": virial,
    }


def tensor_labels(coords: np.ndarray, types: np.ndarray) -> dict[str, np.ndarray]:
    """Wannier-centre-like labels of water-like frames (atoms ``O H H`` per molecule, as
    `random_water_like` lays them out), turning with the frame as a model's tensors must.

    Each oxygen carries the atomic dipole ``-0.4 (d1 + d2)`` (``d`` its O-H bond vectors,
    taken from its own molecule) and the atomic polarizability ``1.5 I + 0.3 (d1 d1ᵀ +
    d2 d2ᵀ)``; hydrogens carry nothing. Returns ``dipole`` (nf, 3), ``atomic_dipole`` (nf,
    N, 3), ``polarizability`` (nf, 9), ``atomic_polarizability`` (nf, N, 9), atoms in file
    order; the global labels are sums over atoms.
    """
    nf, natoms = coords.shape[:2]
    oxygens = np.flatnonzero(types == 0)
    atomic_dipole = np.zeros((nf, natoms, 3))
    atomic_polar = np.zeros((nf, natoms, 3, 3))
    for o in oxygens:
        bonds = coords[:, o + 1 : o + 3] - coords[:, o : o + 1]  # (nf, 2, 3)
        atomic_dipole[:, o] = -0.4 * bonds.sum(axis=1)
        atomic_polar[:, o] = 1.5 * np.eye(3) + 0.3 * np.einsum("fbi,fbj->fij", bonds, bonds)
    return {
        "dipole": atomic_dipole.sum(axis=1),
        "atomic_dipole": atomic_dipole,
        "polarizability": atomic_polar.sum(axis=1).reshape(nf, 9),
        "atomic_polarizability": atomic_polar.reshape(nf, natoms, 9),
    }


MIXED_TYPE_MAP = ["O", "H", "X"]


def mixed_labeled(
    nframes: int = 8,
    nmol: int = 4,
    box_len: float = 5.2,
    seed: int = 0,
    rcut: float = 4.0,
    ncomp: int = 3,
    virtual: bool = False,
    periodic: bool = True,
    shuffle: bool = False,
) -> dict:
    """A labelled mixed-type data set (keyword arguments for the writers, ``real_types``
    included): water-like frames of ``3·nmol`` atoms whose composition cycles through
    ``ncomp`` kinds (frame f relabels its first ``f % ncomp`` hydrogens as type 2, "X").
    ``virtual``: frames with ``f % ncomp == 0`` lose their last molecule, whose three slots
    become virtual atoms (type -1, zero coordinates and forces), as dpdata pads a smaller
    system. ``shuffle``: every frame lists its atom slots in an order of its own (frames of
    one composition then differ in their type rows). ``type.raw`` is all zeros, as dpdata
    writes it."""
    coords, base, boxes = random_water_like(nframes, nmol, box_len, seed)
    natoms = len(base)
    hydrogens = np.flatnonzero(base == 1)
    real = np.repeat(base[None], nframes, axis=0)
    energy, virial = np.zeros(nframes), np.zeros((nframes, 3, 3))
    force = np.zeros((nframes, natoms, 3))
    params = default_pair_params(3)
    for f in range(nframes):
        real[f, hydrogens[: f % ncomp]] = 2
        if virtual and f % ncomp == 0:
            real[f, natoms - 3 :] = -1
            coords[f, natoms - 3 :] = 0.0
        keep = real[f] >= 0
        e, fo, v = lj_labels(
            coords[f : f + 1, keep], real[f, keep], boxes[f : f + 1] if periodic else None,
            rcut, params=params,
        )  # fmt: skip
        energy[f], force[f, keep], virial[f] = e[0], fo[0], v[0]
    if shuffle:
        rng = np.random.default_rng(seed + 1)
        for f in range(nframes):
            order = rng.permutation(natoms)
            coords[f], force[f], real[f] = coords[f, order], force[f, order], real[f, order]
    return {
        "coords": coords,
        "types": np.zeros(natoms, dtype=np.int64),
        "type_map": list(MIXED_TYPE_MAP),
        "boxes": boxes if periodic else None,
        "energy": energy,
        "force": force,
        "virial": virial if periodic else None,
        "real_types": real,
    }
