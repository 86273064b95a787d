"""Synthetic labelled frames for the benchmarks: atoms on a jittered, strained grid, labelled
by a smooth pair potential, computed for many frames at once with numpy only.

Why a grid: an atom sits at ``(site + 0.5 + δ) @ G`` with ``|δ| ≤ JITTER`` (grid units) and
``G = a (I + ε)`` the per-frame grid cell (a small random strain ε), so two atoms are never
closer than ``a (1 - 2 JITTER)(1 - |ε|)`` and every pair within the cutoff is found among a
fixed list of integer grid offsets: no neighbour search, one vectorised pass per offset over
all frames and atoms of a chunk. An offset and its opposite name the same pair, so only half
of them are visited. Offsets longer than the grid (small cells) reach periodic images of an
atom, itself included, so any cell size is handled exactly.

Systems differ in size (occupied sites of an ``n³`` grid, the rest vacancies), composition
(one to three elements of ``TYPE_MAP``) and grid spacing. Labels: the energy is a per-element
constant plus a Morse pair energy times a quintic switch from ``RCUT_SMTH`` to ``RCUT`` (the
form of ASE's ``MorsePotential``, smooth and bounded at short range); forces are ``-dE/dr``
and the virial ``W = -dE/dε`` (DeePMD's convention), both exact derivatives of that energy.

No import from mdtrain or tests: the benchmarks must run against any trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TYPE_MAP = ["Al", "Cu", "Ni"]
ATOM_ENERGY = np.array([-3.2, -1.8, -2.5])  # eV per atom of each element: a bias to learn
RADIUS = np.array([1.38, 1.25, 1.30])  # Å: the Morse minimum of a pair is the sum
DEPTH = np.array([0.12, 0.08, 0.10])  # eV: the well depth of a pair is the geometric mean
STIFFNESS = 3.5  # Morse ρ0
RCUT = 5.0  # Å: the labels' cutoff
RCUT_SMTH = 4.0  # Å: the switch starts here
JITTER = 0.15  # largest displacement from a site, in grid spacings
STRAIN = 0.03  # largest strain component of a frame's cell
SPACING = (2.45, 2.75)  # Å: range of the grid spacing a of a system


def pair_params() -> dict[str, np.ndarray]:
    """Morse parameters per element pair: well depth ε (eV), minimum r0 (Å), stiffness ρ0."""
    return {
        "epsilon": np.sqrt(np.outer(DEPTH, DEPTH)),
        "r0": RADIUS[:, None] + RADIUS[None, :],
        "rho0": np.full((len(TYPE_MAP), len(TYPE_MAP)), STIFFNESS),
    }


@dataclass(frozen=True)
class SystemSpec:
    """The fixed part of a system: its grid, which sites hold atoms, and their elements."""

    index: int
    side: int  # the grid has side³ sites
    spacing: float  # Å
    sites: np.ndarray  # (natoms,) occupied site indices, increasing
    types: np.ndarray  # (natoms,) indices into ``elements``
    elements: list[str]  # the system's own type map (a subset of TYPE_MAP)

    @property
    def natoms(self) -> int:
        return len(self.sites)

    @property
    def model_types(self) -> np.ndarray:
        """Per-atom indices into TYPE_MAP."""
        return np.array([TYPE_MAP.index(e) for e in self.elements])[self.types]


def system_spec(seed: int, index: int, natoms_range: tuple[int, int]) -> SystemSpec:
    """System ``index`` of a data set: the same for a given seed whatever the number of
    systems or frames, so that data sets of different sizes share their systems."""
    lo, hi = natoms_range
    rng = np.random.default_rng([seed, 1, index])
    natoms = int(rng.integers(lo, hi + 1))
    side = max(2, math.ceil(natoms ** (1 / 3) - 1e-9))  # the sites left over are vacancies
    nsites = side**3
    sites = np.sort(rng.choice(nsites, size=natoms, replace=False))
    nelem = int(rng.integers(1, len(TYPE_MAP) + 1))
    chosen = np.sort(rng.choice(len(TYPE_MAP), size=nelem, replace=False))
    fractions = rng.dirichlet(np.full(nelem, 2.0))
    types = rng.choice(nelem, size=natoms, p=fractions)
    types[rng.permutation(natoms)[:nelem]] = np.arange(nelem)  # every element present
    spacing = float(rng.uniform(*SPACING))
    return SystemSpec(index, side, spacing, sites, types, [TYPE_MAP[t] for t in chosen])


def _half_offsets(side: int, spacing: float) -> np.ndarray:
    """Integer grid offsets (k, 3) that can hold a pair within RCUT, one of each ± pair."""
    # sites o apart hold atoms at least (|o| - 2 JITTER)·a·(1 - |ε|) apart, and the strain's
    # spectral norm |ε| is at most its Frobenius norm, 3 STRAIN
    reach = RCUT / (spacing * (1.0 - 3 * STRAIN)) + 2 * JITTER
    m = math.ceil(reach)
    grid = np.stack(np.meshgrid(*[np.arange(-m, m + 1)] * 3, indexing="ij"), -1).reshape(-1, 3)
    keep = np.linalg.norm(grid, axis=1) <= reach
    first = np.where(grid[:, 0] != 0, grid[:, 0], np.where(grid[:, 1] != 0, grid[:, 1], grid[:, 2]))
    return grid[keep & (first > 0)]


def _switch(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quintic switch from 1 at RCUT_SMTH to 0 at RCUT, and its derivative."""
    width = RCUT - RCUT_SMTH
    s = np.minimum(np.maximum((RCUT - d) * (1.0 / width), 0.0), 1.0)
    value = s * s * s * (10.0 + s * (-15.0 + 6.0 * s))
    slope = -(30.0 * s * s * (1.0 - s) ** 2) / width
    return value, slope


_PAIRS_PER_PASS = 1 << 15  # pair-frames per vectorised pass: arrays that stay in cache


def generate_frames(
    spec: SystemSpec, rng: np.random.Generator, nframes: int
) -> dict[str, np.ndarray]:
    """``nframes`` labelled frames of ``spec``: coord (nf, natoms, 3), box (nf, 3, 3), energy
    (nf,), force (nf, natoms, 3), virial (nf, 3, 3), float64, atoms in site order."""
    nsites = spec.side**3
    # displacements: uniform in a ball of radius JITTER (grid units)
    direction = rng.normal(size=(nframes, nsites, 3))
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    delta = direction * (JITTER * rng.uniform(size=(nframes, nsites, 1)) ** (1 / 3))
    strain = rng.uniform(-STRAIN, STRAIN, size=(nframes, 3, 3))
    strain = 0.5 * (strain + strain.transpose(0, 2, 1))
    grid_cell = spec.spacing * (np.eye(3) + strain)  # (nf, 3, 3), rows are cell vectors
    found = pairs(spec, _half_offsets(spec.side, spec.spacing))
    step = max(1, _PAIRS_PER_PASS // max(len(found[0]), 1))
    parts = [
        labels(spec, delta[a : a + step], grid_cell[a : a + step], found)
        for a in range(0, nframes, step)
    ]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def pairs(spec: SystemSpec, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (site, neighbouring site, grid offset) of two atoms that ``offsets`` can bring
    within RCUT: site indices (npairs,) twice and the offsets (npairs, 3)."""
    side, nsites = spec.side, spec.side**3
    occupied = np.zeros(nsites, dtype=bool)
    occupied[spec.sites] = True
    index3 = np.stack(np.unravel_index(np.arange(nsites), (side,) * 3), -1)  # (nsites, 3)
    target = (index3[None] + offsets[:, None]) % side  # (noffsets, nsites, 3)
    neighbour = np.ravel_multi_index(np.moveaxis(target, -1, 0), (side,) * 3)
    keep = occupied[None] & occupied[neighbour]
    which, site = np.nonzero(keep)
    return site, neighbour[which, site], offsets[which]


def labels(
    spec: SystemSpec,
    delta: np.ndarray,
    grid_cell: np.ndarray,
    found: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> dict[str, np.ndarray]:
    """Positions and labels for site displacements ``delta`` (nf, side³, 3) in grid units and
    grid cells ``grid_cell`` (nf, 3, 3); ``found`` are the system's ``pairs``.

    One vectorised pass over every pair of the frames (a loop over offsets cost more in
    Python than in arithmetic for small systems); vectors are kept as three (nf, pairs)
    component arrays so that each step is an elementwise pass over contiguous memory. The
    caller keeps nf·pairs near ``_PAIRS_PER_PASS``: elementwise passes ran 8× slower per
    element once the arrays outgrew the L2 cache."""
    side, nsites = spec.side, spec.side**3
    nf = len(delta)
    site_type = np.zeros(nsites, dtype=np.int64)
    site_type[spec.sites] = spec.model_types
    params = pair_params()
    s_idx, n_idx, offset = found
    ti, tj = site_type[s_idx], site_type[n_idx]
    eps, r0 = params["epsilon"][ti, tj], params["r0"][ti, tj]
    shift = np.moveaxis(delta, -1, 0)  # (3, nf, nsites): gathers along a contiguous axis
    vec = [np.zeros((nf, len(s_idx))) for _ in range(3)]
    for i in range(3):
        component = np.ascontiguousarray(shift[i])
        frac = np.take(component, n_idx, axis=1) - np.take(component, s_idx, axis=1)
        frac += offset[:, i]  # grid units
        for j in range(3):
            vec[j] += frac * grid_cell[:, i, j, None]  # r_j - r_i, Å
    d = np.sqrt(vec[0] * vec[0] + vec[1] * vec[1] + vec[2] * vec[2])
    expf = np.exp(STIFFNESS * (1.0 - d / r0))
    morse = eps * expf * (expf - 2.0)
    dmorse = (-2.0 * STIFFNESS * eps / r0) * expf * (expf - 1.0)
    sw, dsw = _switch(d)
    energy = (morse * sw).sum(axis=1) + ATOM_ENERGY[spec.model_types].sum()
    scale = (dmorse * sw + morse * dsw) / d  # dE/dr_j = scale · (r_j - r_i) = -dE/dr_i
    base = (np.arange(nf) * nsites)[:, None]
    to_j, to_i = (base + n_idx).ravel(), (base + s_idx).ravel()
    force = np.empty((nf, nsites, 3))
    virial = np.empty((nf, 3, 3))
    for i in range(3):
        g = scale * vec[i]
        force[..., i] = (
            np.bincount(to_i, g.ravel(), nf * nsites) - np.bincount(to_j, g.ravel(), nf * nsites)
        ).reshape(nf, nsites)
        for j in range(i, 3):
            virial[:, i, j] = virial[:, j, i] = -np.einsum("fp,fp->f", g, vec[j])
    index3 = np.stack(np.unravel_index(spec.sites, (side,) * 3), -1)
    positions = np.einsum("fsi,fij->fsj", index3 + 0.5 + delta[:, spec.sites], grid_cell)
    return {
        "coord": positions,
        "box": side * grid_cell,
        "energy": energy,
        "force": force[:, spec.sites],
        "virial": virial,
    }


def frame_bytes(natoms: int) -> int:
    """Bytes of one frame in float64 files: coord, force (3·natoms each), box, virial, energy."""
    return 8 * (6 * natoms + 19)
