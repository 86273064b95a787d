"""Generate the small liquid-water data set of this example, labelled with GFN1-xTB.

Why this recipe: a tight-binding reference (GFN1-xTB through the ``tblite`` package) runs offline
in about a second per 96-atom frame, but is too slow to also drive the molecular dynamics that
makes the configurations. So the configurations come from a cheap flexible point-charge water
model (SPC/Fw-like force constants and charges, damped-shifted-force Coulomb, O-O Lennard-Jones)
run with Langevin dynamics at liquid density; frames are taken far enough apart to differ, given
a small random cell strain (so the virial varies and the cells are triclinic), and only then
labelled with GFN1-xTB: energy, forces and virial. The labels are all from GFN1-xTB; the classical
model only chooses where to look.

Output: one deepmd/npy system per entry of ``--system`` (atoms sorted O first, then H;
``type_map.raw`` is "O H"), float64 arrays, energies in eV, forces in eV/Å, virials in eV
(virial = -stress × volume, with ASE's sign of the stress). Deterministic given ``--seed``.

    python generate.py                         # the committed data set (data/), a few minutes
    python generate.py -o /tmp/w --system train/w32:32:10 --seed 3
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ase import Atoms, units

WATER_MOLAR_MASS = 18.015  # g/mol
MASSES = np.array([15.999, 1.008, 1.008])  # O, H, H (amu)
KCAL_MOL = units.kcal / units.mol  # eV
COULOMB = units.Hartree * units.Bohr  # e²/(4πε0) in eV·Å

# The committed data set: (path under the output directory, molecules, frames).
DEFAULT_SYSTEMS = ("train/w32_a:32:40", "train/w32_b:32:40", "train/w64:64:20", "valid/w32:32:20")


@dataclass(frozen=True)
class WaterModel:
    """Flexible point-charge water used only to move the molecules (labels come from GFN1-xTB).

    Force constants, charges and Lennard-Jones parameters are SPC/Fw's (Wu, Tepper, Voth 2006).
    The equilibrium O-H length and H-O-H angle are set so that the sampled molecules look like
    GFN1-xTB's (mean O-H 0.971 Å, H-O-H 104.8° in the liquid, where the mean GFN1-xTB force along
    the O-H bonds is then close to zero; SPC/Fw's own 1.012 Å would leave the bonds stretched).
    """

    r0: float = 0.956  # Å
    theta0: float = math.radians(110.0)
    k_bond: float = 1059.162 * KCAL_MOL  # eV/Å², E = k/2 (r - r0)²
    k_angle: float = 75.90 * KCAL_MOL  # eV/rad², E = k/2 (θ - θ0)²
    q_h: float = 0.41  # e; q_O = -2 q_H
    sigma: float = 3.165492  # Å, O-O only
    epsilon: float = 0.1554253 * KCAL_MOL  # eV
    rcut: float = 8.0  # Å, Coulomb (damped shifted force) and Lennard-Jones
    alpha: float = 0.2  # 1/Å, Coulomb damping

    def energy_forces(self, pos: np.ndarray, cell: np.ndarray) -> tuple[float, np.ndarray]:
        """Energy (eV) and forces (eV/Å) of whole molecules stored O, H, H, O, H, H, ..."""
        e_intra, f_intra = self._intramolecular(pos)
        e_inter, f_inter = self._intermolecular(pos, cell)
        return e_intra + e_inter, f_intra + f_inter

    def _intramolecular(self, pos: np.ndarray) -> tuple[float, np.ndarray]:
        mol = pos.reshape(-1, 3, 3)
        u = mol[:, 1] - mol[:, 0]
        v = mol[:, 2] - mol[:, 0]
        ru = np.linalg.norm(u, axis=1)
        rv = np.linalg.norm(v, axis=1)
        uh, vh = u / ru[:, None], v / rv[:, None]
        cos = np.clip(np.sum(uh * vh, axis=1), -1.0, 1.0)
        theta = np.arccos(cos)
        sin = np.maximum(np.sin(theta), 1e-8)
        energy = 0.5 * self.k_bond * np.sum((ru - self.r0) ** 2 + (rv - self.r0) ** 2)
        energy += 0.5 * self.k_angle * np.sum((theta - self.theta0) ** 2)
        # dE/du and dE/dv (u, v: H1 - O, H2 - O); dθ/du = -(v̂ - cosθ û) / (|u| sinθ)
        da = self.k_angle * (theta - self.theta0) / sin
        g_u = self.k_bond * (ru - self.r0)[:, None] * uh - (da / ru)[:, None] * (
            vh - cos[:, None] * uh
        )
        g_v = self.k_bond * (rv - self.r0)[:, None] * vh - (da / rv)[:, None] * (
            uh - cos[:, None] * vh
        )
        forces = np.stack([g_u + g_v, -g_u, -g_v], axis=1)
        return float(energy), forces.reshape(-1, 3)

    def _intermolecular(self, pos: np.ndarray, cell: np.ndarray) -> tuple[float, np.ndarray]:
        from scipy.special import erfc
        from vesin import NeighborList

        natoms = len(pos)
        frac = np.linalg.solve(cell.T, pos.T).T
        wrapped = (frac - np.floor(frac)) @ cell
        i, j, d = NeighborList(cutoff=self.rcut, full_list=False).compute(
            wrapped, cell, True, quantities="ijD"
        )
        r = np.linalg.norm(d, axis=1)
        # Exclude the molecule's own atoms (its periodic images are ≥ 5 Å away).
        keep = ~((i // 3 == j // 3) & (r < 2.0))
        i, j, d, r = i[keep], j[keep], d[keep], r[keep]
        q = np.where(np.arange(natoms) % 3 == 0, -2.0 * self.q_h, self.q_h)
        qq = COULOMB * q[i] * q[j]
        a, rc = self.alpha, self.rcut
        shift_f = (
            erfc(a * rc) / rc**2 + 2 * a / math.sqrt(math.pi) * math.exp(-((a * rc) ** 2)) / rc
        )
        energy_pair = qq * (erfc(a * r) / r - erfc(a * rc) / rc + shift_f * (r - rc))
        # dE/dr of the pair
        de_dr = qq * (
            -erfc(a * r) / r**2 - 2 * a / math.sqrt(math.pi) * np.exp(-((a * r) ** 2)) / r + shift_f
        )
        oo = (i % 3 == 0) & (j % 3 == 0)
        s6 = (self.sigma / r[oo]) ** 6
        s6c = (self.sigma / rc) ** 6
        energy_pair[oo] += 4 * self.epsilon * (s6**2 - s6 - (s6c**2 - s6c))
        de_dr[oo] += 4 * self.epsilon * (-12 * s6**2 + 6 * s6) / r[oo]
        # Half list, d = r_j - r_i: the pair pushes i along -dE/dr̂ and j the opposite way.
        pair_force = (de_dr / r)[:, None] * d
        forces = np.stack(
            [
                np.bincount(i, pair_force[:, c], natoms) - np.bincount(j, pair_force[:, c], natoms)
                for c in range(3)
            ],
            axis=1,
        )
        return float(energy_pair.sum()), forces


def box_length(nmol: int, density: float) -> float:
    """Edge (Å) of the cubic box holding nmol water molecules at density (g/cm³)."""
    volume = nmol * WATER_MOLAR_MASS / (density * units.mol * 1e-24)
    return volume ** (1.0 / 3.0)


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    """Uniform random rotation matrix (from a normalised Gaussian quaternion)."""
    q = rng.normal(size=4)
    w, x, y, z = q / np.linalg.norm(q)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    )


def random_packing(nmol: int, length: float, rng: np.random.Generator) -> np.ndarray:
    """Randomly oriented molecules (O-H 0.96 Å, H-O-H 104.5°) without overlaps, OHH order.

    Random sequential addition: O-O at least 2.5 Å and other intermolecular pairs at least
    1.5 Å apart (minimum image in the cubic box).
    """
    angle = math.radians(104.5)
    template = np.array(
        [[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [0.96 * math.cos(angle), 0.96 * math.sin(angle), 0.0]]
    )
    placed: list[np.ndarray] = []
    for _ in range(200 * nmol):
        if len(placed) == nmol:
            break
        mol = template @ random_rotation(rng).T + rng.uniform(0.0, length, size=3)
        if placed:
            others = np.concatenate(placed)
            d = mol[:, None, :] - others[None, :, :]
            dist = np.linalg.norm(d - length * np.round(d / length), axis=2)
            is_oo = np.zeros_like(dist, dtype=bool)
            is_oo[0, 0::3] = True
            if (dist[is_oo] < 2.5).any() or (dist[~is_oo] < 1.5).any():
                continue
        placed.append(mol)
    if len(placed) < nmol:
        raise RuntimeError(f"could not place {nmol} molecules in a {length:.2f} Å box")
    return np.concatenate(placed)


def langevin(
    pos: np.ndarray,
    vel: np.ndarray,
    cell: np.ndarray,
    model: WaterModel,
    rng: np.random.Generator,
    nsteps: int,
    dt_fs: float,
    temperature: float,
    friction_per_fs: float,
) -> tuple[np.ndarray, np.ndarray]:
    """BAOAB Langevin dynamics; returns the new positions and velocities (ASE units)."""
    natoms = len(pos)
    mass = np.tile(MASSES, natoms // 3)[:, None]
    dt = dt_fs * units.fs
    c1 = math.exp(-friction_per_fs * dt_fs)
    c2 = np.sqrt((1.0 - c1 * c1) * units.kB * temperature / mass)
    _, forces = model.energy_forces(pos, cell)
    for _ in range(nsteps):
        vel = vel + 0.5 * dt * forces / mass
        pos = pos + 0.5 * dt * vel
        vel = c1 * vel + c2 * rng.normal(size=vel.shape)
        pos = pos + 0.5 * dt * vel
        _, forces = model.energy_forces(pos, cell)
        vel = vel + 0.5 * dt * forces / mass
    return pos, vel


def strained_frame(
    pos: np.ndarray, cell: np.ndarray, max_strain: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Apply a random symmetric strain to the cell and the oxygens (molecules stay rigid),
    then wrap each whole molecule into the cell by its oxygen."""
    eps = rng.uniform(-max_strain, max_strain, size=(3, 3))
    deform = np.eye(3) + 0.5 * (eps + eps.T)
    new_cell = cell @ deform
    mol = pos.reshape(-1, 3, 3)
    oxygen = mol[:, 0] @ deform
    frac = np.linalg.solve(new_cell.T, oxygen.T).T
    oxygen = oxygen - np.floor(frac) @ new_cell
    mol = mol - mol[:, :1] + oxygen[:, None, :]
    return mol.reshape(-1, 3), new_cell


def gfn1_labels(pos: np.ndarray, cell: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """GFN1-xTB energy (eV), forces (eV/Å) and virial (eV) of one periodic frame.

    A fresh calculator per frame, so a label does not depend on the frame labelled before it.
    """
    from tblite.ase import TBLite

    atoms = Atoms("OHH" * (len(pos) // 3), positions=pos, cell=cell, pbc=True)
    atoms.calc = TBLite(method="GFN1-xTB", accuracy=1.0, electronic_temperature=300.0, verbosity=0)
    energy = atoms.get_potential_energy()
    forces = atoms.get_forces()
    # ASE's stress is (1/V) dE/dε; the DeePMD-compatible virial is -dE/dε.
    virial = -atoms.get_stress(voigt=False) * atoms.get_volume()
    return float(energy), forces, virial


def write_system(path: Path, frames: dict[str, np.ndarray], set_size: int) -> None:
    """Write a deepmd/npy system with the atoms sorted by type (O first, then H)."""
    nmol = frames["coord"].shape[1] // 3
    order = np.concatenate(
        [np.arange(0, 3 * nmol, 3), np.setdiff1d(np.arange(3 * nmol), np.arange(0, 3 * nmol, 3))]
    )
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("set.*"):  # from an earlier run with more frames or smaller sets
        shutil.rmtree(stale)
    (path / "type.raw").write_text("0\n" * nmol + "1\n" * (2 * nmol))
    (path / "type_map.raw").write_text("O\nH\n")
    nframes = len(frames["energy"])
    arrays = {
        "coord": frames["coord"][:, order].reshape(nframes, -1),
        "box": frames["box"].reshape(nframes, 9),
        "energy": frames["energy"],
        "force": frames["force"][:, order].reshape(nframes, -1),
        "virial": frames["virial"].reshape(nframes, 9),
    }
    for k, start in enumerate(range(0, nframes, set_size)):
        set_dir = path / f"set.{k:03d}"
        set_dir.mkdir(exist_ok=True)
        for name, array in arrays.items():
            np.save(
                set_dir / f"{name}.npy",
                np.ascontiguousarray(array[start : start + set_size], dtype=np.float64),
            )


def generate_system(
    name: str, nmol: int, nframes: int, seed: np.random.SeedSequence, args: argparse.Namespace
) -> dict[str, np.ndarray]:
    """Equilibrate a random packing with the classical model, then sample and label frames."""
    rng = np.random.default_rng(seed)
    model = WaterModel()
    length = box_length(nmol, args.density)
    cell = np.eye(3) * length
    pos = random_packing(nmol, length, rng)
    mass = np.tile(MASSES, nmol)[:, None]
    vel = rng.normal(size=pos.shape) * np.sqrt(units.kB * args.temperature / mass)
    t0 = time.perf_counter()
    # Strong friction first: the random packing has no hydrogen-bond network yet.
    pos, vel = langevin(pos, vel, cell, model, rng, 400, args.dt, args.temperature, 0.1)
    nequil = round(args.equilibrate * 1000 / args.dt)
    pos, vel = langevin(pos, vel, cell, model, rng, nequil, args.dt, args.temperature, 0.01)
    t1 = time.perf_counter()
    stride = max(1, round(args.stride / args.dt))
    out: dict[str, list] = {k: [] for k in ("coord", "box", "energy", "force", "virial")}
    for frame in range(nframes):
        pos, vel = langevin(pos, vel, cell, model, rng, stride, args.dt, args.temperature, 0.01)
        coord, box = strained_frame(pos, cell, args.strain, rng)
        energy, force, virial = gfn1_labels(coord, box)
        for key, value in zip(out, (coord, box, energy, force, virial)):
            out[key].append(value)
        print(
            f"  {name}: frame {frame + 1}/{nframes}  E = {energy:.4f} eV  max|F| = {np.abs(force).max():.2f} eV/Å",
            flush=True,
        )
    t2 = time.perf_counter()
    print(
        f"{name}: {nmol} molecules, {nframes} frames, box {length:.3f} Å; classical MD {t1 - t0:.1f} s + sampling/labelling {t2 - t1:.1f} s",
        flush=True,
    )
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def parse_system(text: str) -> tuple[str, int, int]:
    """'path:molecules:frames' -> (path, molecules, frames)."""
    try:
        path, nmol, nframes = text.rsplit(":", 2)
        return path, int(nmol), int(nframes)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PATH:MOLECULES:FRAMES, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "-o", "--output", default=str(Path(__file__).parent / "data"), help="output directory"
    )
    parser.add_argument(
        "--system",
        type=parse_system,
        action="append",
        metavar="PATH:MOLECULES:FRAMES",
        help=f"system to make, repeatable (default: {' '.join(DEFAULT_SYSTEMS)})",
    )
    parser.add_argument(
        "--seed", type=int, default=20240601, help="random seed (packings, dynamics, strains)"
    )
    parser.add_argument("--density", type=float, default=1.0, help="g/cm³")
    parser.add_argument(
        "--temperature", type=float, default=300.0, help="K, of the classical dynamics"
    )
    parser.add_argument(
        "--dt", type=float, default=0.5, help="time step of the classical dynamics (fs)"
    )
    parser.add_argument(
        "--equilibrate", type=float, default=1.0, help="classical equilibration (ps)"
    )
    parser.add_argument("--stride", type=float, default=50.0, help="time between frames (fs)")
    parser.add_argument(
        "--strain", type=float, default=0.02, help="largest strain component of a frame's cell"
    )
    parser.add_argument("--set-size", type=int, default=20, help="frames per set.* directory")
    args = parser.parse_args(argv)
    systems = args.system or [parse_system(s) for s in DEFAULT_SYSTEMS]

    output = Path(args.output)
    start = time.perf_counter()
    seeds = np.random.SeedSequence(args.seed).spawn(len(systems))
    for (name, nmol, nframes), seed in zip(systems, seeds):
        frames = generate_system(name, nmol, nframes, seed, args)
        write_system(output / name, frames, args.set_size)
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "system")}
    settings["systems"] = [f"{n}:{m}:{f}" for n, m, f in systems]
    settings["reference"] = "GFN1-xTB (tblite), accuracy 1.0, electronic temperature 300 K"
    (output / "generation.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"done in {time.perf_counter() - start:.0f} s -> {output}")


if __name__ == "__main__":
    main()
