"""NVE molecular dynamics with MDTrainCalculator conserves the total energy.

Setup: 8 water-like molecules (24 atoms) in a periodic 6.4 Å box, a tiny float64 model with
random weights (rcut 4 Å, smooth switch from 0.5 Å), 300 K Maxwell-Boltzmann velocities,
velocity Verlet with 0.5 fs steps for 200 steps (100 fs). Atoms cross the cutoff many times.

A model with random weights has no short-range repulsion: on its own, hydrogens fly through
oxygens (distances below 0.1 Å, forces above 10 eV/Å) and no integrator conserves energy
there. A smooth Lennard-Jones wall from ASE (σ = 0.8 Å, zero beyond 1.2 Å) keeps atoms
≳0.6 Å apart; the model's energy varies about twice as much as the wall's (checked below).

Tolerance: max |E_tot(t) - E_tot(0)| ≤ 1% of the kinetic-energy range over the run (here
0.28 eV, so 2.8e-3 eV, ~1e-4 eV/atom). Measured: 2.9e-4 eV. It is meaningful because the
same run with the model's forces scaled by 1.05 (forces no longer -dE/dx) drifts by
1.3e-2 eV and fails it; and the drift of a correct force field falls ~4× when the step is
halved (second order; measured 3.7×), which the test also checks.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms, units
from ase.calculators.lj import LennardJones
from ase.calculators.mixing import SumCalculator
from ase.md.verlet import VelocityVerlet

from mdtrain.infer.calculator import MDTrainCalculator
from tests.helpers.datagen import random_water_like
from tests.helpers.models import tiny_model

TOLERANCE_OF_KE_RANGE = 0.01


class ScaledForces(MDTrainCalculator):
    """Negative control: forces multiplied by ``factor`` (no longer the energy's gradient)."""

    def __init__(self, model, factor: float) -> None:
        super().__init__(model)
        self.factor = factor

    def calculate(self, *args, **kwargs) -> None:
        super().calculate(*args, **kwargs)
        self.results["forces"] = self.results["forces"] * self.factor


def run_nve(calc: MDTrainCalculator, nsteps: int, dt_fs: float, seed: int = 0) -> dict:
    """Velocity Verlet from 300 K velocities; total, kinetic, model and wall energies per step."""
    coords, types, boxes = random_water_like(1, 8, 6.4, seed=seed)
    atoms = Atoms(
        ["O" if t == 0 else "H" for t in types], positions=coords[0], cell=boxes[0], pbc=True
    )
    wall = LennardJones(epsilon=0.01, sigma=0.8, rc=1.2, ro=0.9, smooth=True)
    atoms.calc = SumCalculator([calc, wall])
    rng = np.random.default_rng(seed)
    masses = atoms.get_masses()[:, None]
    momenta = rng.normal(size=(len(atoms), 3)) * np.sqrt(masses * units.kB * 300.0)
    atoms.set_momenta(momenta - masses * momenta.sum(0) / masses.sum())  # no drift of the centre
    rows: list[tuple[float, float, float, float]] = []

    def record() -> None:
        kinetic = atoms.get_kinetic_energy()
        total = kinetic + atoms.get_potential_energy()
        rows.append((total, kinetic, calc.results["energy"], wall.results["energy"]))

    record()
    dyn = VelocityVerlet(atoms, timestep=dt_fs * units.fs)
    dyn.attach(record, interval=1)
    dyn.run(nsteps)
    total, kinetic, model, wall_e = np.array(rows).T
    distances = atoms.get_all_distances(mic=True)[np.triu_indices(len(atoms), 1)]
    return {
        "total": total,
        "kinetic": kinetic,
        "model": model,
        "wall": wall_e,
        "mind": distances.min(),
    }


def drift(run: dict, nsteps: int | None = None) -> float:
    total = run["total"][: None if nsteps is None else nsteps + 1]
    return float(np.abs(total - total[0]).max())


def test_nve_energy_conservation():
    model = tiny_model()
    run = run_nve(MDTrainCalculator(model), nsteps=200, dt_fs=0.5)
    ke_range = float(np.ptp(run["kinetic"]))
    tolerance = TOLERANCE_OF_KE_RANGE * ke_range
    # the test is not vacuous: energy flows between kinetic and model potential energy
    assert ke_range > 0.05
    assert np.ptp(run["model"]) > np.ptp(run["wall"])
    assert run["mind"] > 0.4
    assert drift(run) < tolerance, (drift(run), tolerance)

    # second order: half the step over the same 50 fs gives about a quarter of the drift
    half = run_nve(MDTrainCalculator(model), nsteps=200, dt_fs=0.25)
    ratio = drift(run, 100) / drift(half)
    assert 2.5 < ratio < 6.0, ratio

    # negative control: forces 5% off their true value break conservation by far
    wrong = run_nve(ScaledForces(model, 1.05), nsteps=200, dt_fs=0.5)
    assert drift(wrong) > 3 * tolerance, (drift(wrong), tolerance)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.slow
def test_nve_energy_conservation_other_seeds(seed):
    """The same bound holds for other models and starting points (a sample of those tried)."""
    run = run_nve(MDTrainCalculator(tiny_model(seed)), nsteps=200, dt_fs=0.5, seed=seed)
    assert drift(run) < TOLERANCE_OF_KE_RANGE * np.ptp(run["kinetic"])
