"""Inference with the model on another device, checked without a GPU (``OtherDevice``,
tests/helpers/placement.py): checkpoints and frozen files load onto the device asked for, and
``mdtrain test``'s evaluation and the ASE calculator give the CPU's numbers from there."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms

from mdtrain.data import open_system
from mdtrain.infer.calculator import MDTrainCalculator
from mdtrain.infer.freeze import freeze_model
from mdtrain.infer.load import load_model
from mdtrain.infer.test import evaluate_system
from tests.helpers.models import save_tiny_checkpoint, tiny_model, triclinic, water_like
from tests.helpers.placement import OTHER, OtherDevice, module_devices


@pytest.fixture(params=["checkpoint", "frozen"])
def model_file(request, tmp_path) -> str:
    if request.param == "checkpoint":
        return save_tiny_checkpoint(tmp_path / "model.ckpt.pt")
    path = str(tmp_path / "model.pth")
    freeze_model(tiny_model(), path)
    return path


def test_evaluation_on_another_device_equals_the_cpu(model_file, water_system):
    system = open_system(water_system, ["O", "H"])
    expected = evaluate_system(load_model(model_file, "cpu"), system, 5)
    with OtherDevice():
        model = load_model(model_file, OTHER)
        assert module_devices(model) == {OTHER} and model.backend == "fused"
        got = evaluate_system(model, system, 5, OTHER)
    assert got.label.keys() == expected.label.keys() == {"energy", "force", "virial"}
    for key in ("energy", "force", "virial"):
        np.testing.assert_allclose(got.pred[key], expected.pred[key], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(got.label[key], expected.label[key])


@pytest.mark.parametrize("periodic", [True, False])
def test_calculator_on_another_device_equals_the_cpu(model_file, periodic):
    box = triclinic(5.2, seed=3) if periodic else None
    coord, atype = water_like(3, box, seed=3)
    atoms = Atoms(["OH"[t] for t in atype], positions=coord, cell=box, pbc=periodic)
    atoms.calc = MDTrainCalculator(model_file, device="cpu")
    names = ["energy", "energies", "forces"] + (["stress"] if periodic else [])
    expected = {n: np.copy(atoms.calc.get_property(n, atoms)) for n in names}
    with OtherDevice():
        calc = MDTrainCalculator(model_file, device=OTHER)
        assert module_devices(calc.model) == {OTHER}
        got = {n: np.copy(calc.get_property(n, atoms)) for n in names}
        live = MDTrainCalculator(load_model(model_file, "cpu"), device=OTHER)  # a module moved
        assert module_devices(live.model) == {OTHER}
        np.testing.assert_allclose(live.get_property("forces", atoms), expected["forces"])
    for name in names:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-12, atol=1e-12)
