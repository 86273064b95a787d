"""``CommitteeCalculator``: the mean of the members' own ``MDTrainCalculator`` results, the
deviations as ``mdtrain model-devi`` defines them (checked against the independent
definitions in tests/helpers/committee.py), and an ASE MD loop that stops on high deviation."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms, units
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet

from mdtrain.calculator import CommitteeCalculator, MDTrainCalculator
from mdtrain.errors import MDTrainError
from tests.helpers.committee import committee_folder, member_model, reference_deviation
from tests.helpers.datagen import random_water_like
from tests.helpers.models import TINY_CONFIG, tiny_model
from tests.helpers.placement import OTHER, OtherDevice

# ASE 3.29's MaxwellBoltzmannDistribution calls a deprecated function of its own
pytestmark = pytest.mark.filterwarnings("ignore:Use thermalize_momenta:DeprecationWarning")


@pytest.fixture(scope="module")
def members():
    return [member_model(k) for k in range(3)] + [member_model(3, rcut=3.5, sel=[12, 24])]


def water(periodic: bool, seed: int = 5) -> Atoms:
    coords, types, boxes = random_water_like(1, 8, 6.5, seed=seed, triclinic=True)
    symbols = ["OH"[t] for t in types]
    return Atoms(symbols, positions=coords[0], cell=boxes[0] if periodic else None, pbc=periodic)


@pytest.mark.parametrize("periodic", [True, False])
def test_means_and_deviations(members, periodic):
    atoms = water(periodic)
    singles = []
    for model in members:
        atoms.calc = MDTrainCalculator(model)
        singles.append(
            {
                "energy": atoms.get_potential_energy(),
                "forces": atoms.get_forces(),
                "energies": atoms.get_potential_energies(),
                **({"stress": atoms.get_stress()} if periodic else {}),
                "virial": atoms.calc.model(*_inputs(atoms, model))["virial"][0].detach().numpy(),
            }
        )
    calc = CommitteeCalculator(members)
    atoms.calc = calc
    for key in ("energy", "forces", "energies", *(["stress"] if periodic else [])):
        mean = np.mean([s[key] for s in singles], axis=0)
        np.testing.assert_allclose(calc.get_property(key, atoms), mean, rtol=1e-12, atol=1e-12)
    expected = reference_deviation(
        np.array([s["energy"] for s in singles]),
        np.stack([s["forces"] for s in singles]),
        np.stack([s["virial"] for s in singles]),
    )
    r = calc.results
    got = [
        r["max_virial_deviation"],
        r["min_virial_deviation"],
        r["avg_virial_deviation"],
        r["max_force_deviation"],
        r["min_force_deviation"],
        r["avg_force_deviation"],
        r["energy_deviation"],
        *r["force_deviation"],
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert atoms.calc.get_property("max_force_deviation", atoms) == r["max_force_deviation"]
    np.testing.assert_allclose(r["committee_energy"], [s["energy"] for s in singles], rtol=1e-12)
    assert r["committee_forces"].shape == (4, len(atoms), 3)


def _inputs(atoms, model):
    """Model inputs of ``atoms`` for a direct call (the virial is no ASE property)."""
    import torch

    from mdtrain.neighbors.nlist import build_nlist

    types = np.array(["OH".index(s) for s in atoms.get_chemical_symbols()])
    box = np.asarray(atoms.cell) if atoms.pbc.all() else None
    nlist, shift, _ = build_nlist(atoms.positions, box, types, float(model.rcut), list(model.sel))
    return (
        torch.tensor(atoms.positions)[None],
        torch.tensor(types),
        None if box is None else torch.tensor(box)[None],
        torch.tensor(nlist)[None],
        torch.tensor(shift)[None],
    )


def test_relative_deviation(members):
    atoms = water(True)
    plain = CommitteeCalculator(members[:3])
    relative = CommitteeCalculator(members[:3], relative=1.0)
    atoms.calc = plain
    forces = plain.get_property("forces", atoms)
    absolute = plain.results["force_deviation"]
    atoms.calc = relative
    atoms.get_forces()
    expected = absolute / (np.linalg.norm(forces, axis=1) + 1.0)
    np.testing.assert_allclose(relative.results["force_deviation"], expected, rtol=1e-12)


def test_committee_folder_and_mixed_members(members, tmp_path):
    folder = committee_folder(tmp_path / "committee", members[:2])
    atoms = water(True)
    atoms.calc = CommitteeCalculator(folder)
    from_folder = atoms.get_forces()
    atoms.calc = CommitteeCalculator([members[0], f"{folder}/member-1/model.ckpt.pt"])
    np.testing.assert_allclose(atoms.get_forces(), from_folder, atol=1e-12)
    with pytest.raises(MDTrainError, match="at least two models"):
        CommitteeCalculator([members[0]])
    odd = tiny_model(config={**TINY_CONFIG, "type_map": ["H", "O"]})
    with pytest.raises(MDTrainError, match="type_map"):
        CommitteeCalculator([members[0], odd])


def test_on_another_device_equals_the_cpu(members):
    atoms = water(True)
    atoms.calc = CommitteeCalculator(members[:2])
    expected = atoms.get_forces(), atoms.calc.results["force_deviation"]
    with OtherDevice():  # fresh members: moving a module moves it in place
        calc = CommitteeCalculator([member_model(0), member_model(1)], device=OTHER)
        forces = calc.get_property("forces", atoms)
        deviation = calc.results["force_deviation"]
    np.testing.assert_allclose(forces, expected[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(deviation, expected[1], rtol=1e-12, atol=1e-12)


def run_until(atoms: Atoms, threshold: float, steps: int) -> list[float]:
    """The MD loop a user writes: velocity Verlet on the committee's mean forces, stopped as
    soon as the largest force deviation exceeds ``threshold``; the deviations seen."""
    MaxwellBoltzmannDistribution(atoms, temperature_K=600, rng=np.random.default_rng(0))
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    seen = []
    for _ in dyn.irun(steps):  # yields before the first step, then after each
        seen.append(atoms.calc.results["max_force_deviation"])
        if seen[-1] > threshold:
            break
    return seen


def test_md_loop_stops_on_high_deviation(members):
    # a free run tells where the deviation goes; a threshold inside that range must stop
    # the same (deterministic) run at the first step above it, and no earlier
    atoms = water(True)
    atoms.calc = CommitteeCalculator(members[:3])
    free = run_until(atoms, np.inf, 40)
    assert len(free) == 41 and np.ptp(free) > 1e-3  # the deviation follows the motion
    threshold = float(np.quantile(free, 0.75))
    first_above = int(np.argmax(np.array(free) > threshold))
    atoms = water(True)
    atoms.calc = CommitteeCalculator(members[:3])
    stopped = run_until(atoms, threshold, 40)
    assert len(stopped) == first_above + 1 < len(free)
    np.testing.assert_allclose(stopped, free[: first_above + 1], rtol=1e-12)
    assert stopped[-1] > threshold >= max(stopped[:-1])
    # what stopped the loop is the deviation of the atoms where they stopped
    here = atoms.copy()
    here.calc = CommitteeCalculator(members[:3])
    assert here.calc.get_property("max_force_deviation", here) == pytest.approx(stopped[-1])
