"""The ASE calculator against the model and against finite differences of its own energy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.calculators.calculator import PropertyNotImplementedError

from mdtrain.errors import MDTrainError
from mdtrain.infer.calculator import MDTrainCalculator
from tests.helpers.models import evaluate, make_model, triclinic, water_like

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*deprecated:DeprecationWarning")


@pytest.fixture(scope="module")
def model():
    return make_model({"sel": [16, 32]}).eval()


def water_atoms(periodic: bool = True, seed: int = 21) -> Atoms:
    box = triclinic(5.2, seed=seed) if periodic else None
    coord, atype = water_like(3, box, seed=seed)
    symbols = ["O" if t == 0 else "H" for t in atype]
    return Atoms(symbols, positions=coord, cell=box if periodic else None, pbc=periodic)


def test_matches_model_and_shuffled_symbols(model):
    atoms = water_atoms()
    atoms.calc = MDTrainCalculator(model)
    ref = evaluate(model, atoms.positions, np.asarray(atoms.cell), np.array([0] * 3 + [1] * 6))
    assert atoms.get_potential_energy() == pytest.approx(float(ref["energy"]), abs=1e-12)
    assert atoms.get_potential_energy(force_consistent=True) == pytest.approx(float(ref["energy"]))
    np.testing.assert_allclose(atoms.get_forces(), ref["force"], atol=1e-12)
    stress = -ref["virial"] / atoms.get_volume()
    voigt = [stress[0, 0], stress[1, 1], stress[2, 2], stress[1, 2], stress[0, 2], stress[0, 1]]
    np.testing.assert_allclose(atoms.get_stress(), voigt, atol=1e-12)
    np.testing.assert_allclose(atoms.get_potential_energies().sum(), ref["energy"], atol=1e-12)
    # symbols in any order map through type_map
    perm = np.random.default_rng(0).permutation(len(atoms))
    shuffled = atoms[perm]
    shuffled.calc = MDTrainCalculator(model)
    assert shuffled.get_potential_energy() == pytest.approx(float(ref["energy"]), abs=1e-10)
    np.testing.assert_allclose(shuffled.get_forces(), ref["force"][perm], atol=1e-10)


def test_stress_and_forces_are_derivatives_of_the_energy(model):
    atoms = water_atoms(seed=22)
    atoms.calc = MDTrainCalculator(model)
    stress = atoms.get_stress()
    forces = atoms.get_forces()
    cell0, pos0, vol = atoms.get_cell().copy(), atoms.positions.copy(), atoms.get_volume()
    h = 1e-5
    pairs = [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]
    fd = []
    for a, b in pairs:
        energies = []
        for sign in (1, -1):
            eps = np.zeros((3, 3))
            eps[a, b] = eps[b, a] = sign * h  # symmetric strain
            atoms.set_cell(cell0 @ (np.eye(3) + eps), scale_atoms=False)
            atoms.positions = pos0 @ (np.eye(3) + eps)
            energies.append(atoms.get_potential_energy())
        d = (energies[0] - energies[1]) / (2 * h)
        fd.append(d / vol if a == b else d / (2 * vol))
    atoms.set_cell(cell0)
    atoms.positions = pos0
    np.testing.assert_allclose(stress, fd, rtol=1e-6, atol=1e-9 * np.abs(stress).max())
    for i, k in [(0, 0), (4, 2), (8, 1)]:
        energies = []
        for sign in (1, -1):
            pos = pos0.copy()
            pos[i, k] += sign * h
            atoms.positions = pos
            energies.append(atoms.get_potential_energy())
        assert forces[i, k] == pytest.approx(-(energies[0] - energies[1]) / (2 * h), rel=1e-6)


def test_checkpoint_and_frozen_model_files(model, tmp_path):
    from mdtrain.train.checkpoint import save_checkpoint

    ckpt = tmp_path / "model.ckpt.pt"
    save_checkpoint(
        ckpt, {"model_config": model.get_model_config(), "model_state": model.state_dict()}
    )
    frozen = tmp_path / "frozen.pth"
    torch.jit.save(torch.jit.script(model), str(frozen))
    atoms = water_atoms(seed=23)
    atoms.calc = MDTrainCalculator(model)
    e_ref, f_ref, s_ref = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    for path in (ckpt, str(frozen)):
        atoms.calc = MDTrainCalculator(path)
        assert atoms.calc.type_map == ["O", "H"] and atoms.calc.sel == [16, 32]
        assert atoms.get_potential_energy() == pytest.approx(e_ref, abs=1e-12)
        np.testing.assert_allclose(atoms.get_forces(), f_ref, atol=1e-12)
        np.testing.assert_allclose(atoms.get_stress(), s_ref, atol=1e-12)
    with torch.no_grad():  # a frozen model still gets forces inside a no_grad caller
        atoms.calc = MDTrainCalculator(str(frozen))
        np.testing.assert_allclose(atoms.get_forces(), f_ref, atol=1e-12)


def test_non_periodic_has_no_stress(model):
    atoms = water_atoms(periodic=False)
    atoms.calc = MDTrainCalculator(model)
    ref = evaluate(model, atoms.positions, None, np.array([0] * 3 + [1] * 6))
    assert atoms.get_potential_energy() == pytest.approx(float(ref["energy"]), abs=1e-12)
    with pytest.raises(PropertyNotImplementedError):
        atoms.get_stress()


def test_user_errors(model, tmp_path):
    atoms = water_atoms()
    atoms.pbc = [True, True, False]
    atoms.calc = MDTrainCalculator(model)
    with pytest.raises(MDTrainError, match="pbc"):
        atoms.get_potential_energy()
    atoms = water_atoms()
    atoms[0].symbol = "C"
    atoms.calc = MDTrainCalculator(model)
    with pytest.raises(MDTrainError, match="C not in the model type_map"):
        atoms.get_potential_energy()
    with pytest.raises(MDTrainError, match="not found"):
        MDTrainCalculator(tmp_path / "missing.pt")


def test_short_import_is_the_same_class():
    """``mdtrain.calculator`` is the documented import path; it re-exports the classes."""
    import mdtrain.calculator as short
    from mdtrain.infer.calculator import CommitteeCalculator

    assert short.MDTrainCalculator is MDTrainCalculator
    assert short.CommitteeCalculator is CommitteeCalculator
    assert short.__all__ == ["CommitteeCalculator", "MDTrainCalculator"]
