"""Molecular dynamics in LAMMPS with an mdtrain model: ``mdtrain freeze -o model.dp``,
``dp convert-backend model.dp model.pb``, then ``pair_style deepmd model.pb`` in the LAMMPS
of DeePMD-kit's environment (its ``lmp``). Ten NVE steps of a 27-molecule water box start
at mdtrain's energy and forces (1e-8 relative; dumped at step 0) and conserve the total
energy. LAMMPS numbers its types H = 1, O = 2 here, the reverse of the model's type_map, so
``pair_coeff * * H O`` must do the mapping.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from mdtrain.cli import main
from tests.helpers.datagen import random_water_like
from tests.helpers.deepmd import rel_diff
from tests.helpers.models import evaluate, save_tiny_checkpoint, tiny_model

pytestmark = pytest.mark.interop

BOX = 9.3  # Å: 27 molecules, about 1 g/cm³
STEPS = 10
DRIFT = 1e-5  # eV/atom: the largest |E_total(t) - E_total(0)| accepted over the run
MASSES = {"H": 1.008, "O": 15.999}
LAMMPS_TYPES = ["H", "O"]  # LAMMPS type 1, 2

INPUT = f"""units metal
boundary p p p
atom_style atomic
atom_modify map yes
read_data water.data
pair_style deepmd model.pb
pair_coeff * * {" ".join(LAMMPS_TYPES)}
velocity all create 300.0 4928459 mom yes rot yes dist gaussian
timestep 0.0005
fix 1 all nve
thermo_style custom step pe ke etotal
thermo_modify format float %.16e
thermo 1
dump 1 all custom {STEPS} forces.dump id type x y z fx fy fz
dump_modify 1 sort id format float %.16e
run {STEPS}
"""


def write_data(path, coord: np.ndarray, names: list[str]) -> None:
    """A LAMMPS data file (atomic style) of ``coord`` in a cubic box, LAMMPS_TYPES numbering."""
    lines = [
        "water written by tests/interop/test_lammps.py",
        "",
        f"{len(coord)} atoms",
        f"{len(LAMMPS_TYPES)} atom types",
        "",
        f"0.0 {BOX!r} xlo xhi",
        f"0.0 {BOX!r} ylo yhi",
        f"0.0 {BOX!r} zlo zhi",
        "",
        "Masses",
        "",
        *[f"{i + 1} {MASSES[name]}" for i, name in enumerate(LAMMPS_TYPES)],
        "",
        "Atoms # atomic",
        "",
    ]
    for i, (name, xyz) in enumerate(zip(names, coord, strict=True)):
        kind = LAMMPS_TYPES.index(name) + 1
        lines.append(f"{i + 1} {kind} " + " ".join(repr(float(x)) for x in xyz))
    path.write_text("\n".join(lines) + "\n")


def thermo_rows(log: str) -> np.ndarray:
    """The (step, pe, ke, etotal) rows of the run's thermo table."""
    rows = []
    for line in log.splitlines():
        parts = line.split()
        if len(parts) == 4 and re.fullmatch(r"\d+", parts[0]):
            try:
                rows.append([float(p) for p in parts])
            except ValueError:
                continue
    return np.array(rows)


def first_dump(path) -> np.ndarray:
    """Per-atom rows (id, type, x, y, z, fx, fy, fz) of the first snapshot, sorted by id."""
    lines = path.read_text().splitlines()
    n = int(lines[3])
    start = lines.index(next(x for x in lines if x.startswith("ITEM: ATOMS"))) + 1
    return np.array([[float(v) for v in line.split()] for line in lines[start : start + n]])


@pytest.fixture(scope="module")
def run(deepmd, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("lammps")
    model = tiny_model(seed=3)  # rcut 4, sel [16, 32], two-sided, non-trivial statistics
    checkpoint = save_tiny_checkpoint(tmp / "model.pt", model)
    assert main(["freeze", checkpoint, "-o", str(tmp / "model.dp")]) == 0
    deepmd.dp_cmd(["convert-backend", "model.dp", "model.pb"], tmp)
    coord, types, boxes = random_water_like(1, 27, BOX, seed=31)
    coord = np.mod(coord[0], BOX)  # inside the box, as LAMMPS keeps them
    names = [model.type_map[t] for t in types]
    write_data(tmp / "water.data", coord, names)
    (tmp / "in.lammps").write_text(INPUT)
    log = deepmd.run(["lmp", "-in", "in.lammps", "-log", "log.lammps"], tmp)
    return {
        "ours": evaluate(model, coord, boxes[0], types),
        "thermo": thermo_rows((tmp / "log.lammps").read_text()),
        "dump": first_dump(tmp / "forces.dump"),
        "coord": coord,
        "natoms": len(coord),
        "log": log,
    }


def test_lammps_starts_at_mdtrains_energy_and_forces(run):
    thermo, dump, ours = run["thermo"], run["dump"], run["ours"]
    assert thermo.shape == (STEPS + 1, 4), run["log"][-2000:]
    assert np.array_equal(dump[:, 0], np.arange(1, run["natoms"] + 1))
    np.testing.assert_allclose(dump[:, 2:5], run["coord"], atol=1e-12)  # same atoms, same order
    energy = rel_diff(thermo[0, 1], ours["energy"])
    force = rel_diff(dump[:, 5:8], ours["force"])
    print(f"LAMMPS vs mdtrain at step 0: energy {energy:.1e}, forces {force:.1e} (relative)")
    assert energy < 1e-8 and force < 1e-8, (energy, force)


def test_lammps_conserves_energy(run):
    thermo = run["thermo"]
    total = thermo[:, 3]
    drift = float(np.abs(total - total[0]).max()) / run["natoms"]
    kinetic = float(thermo[0, 2])
    print(
        f"LAMMPS NVE, {STEPS} steps of 0.5 fs: |E_total - E_total(0)| <= {drift:.1e} eV/atom "
        f"(kinetic energy {kinetic:.3f} eV, potential moved by {np.ptp(thermo[:, 1]):.3e} eV)"
    )
    assert kinetic > 1.0  # the atoms do move (300 K)
    assert drift < DRIFT
