"""The ASE calculator of dipole and polar models: ``atoms.get_dipole_moment()`` and
``get_property("polarizability")`` are the model's tensors, per atom in the ``Atoms``' own
order, and turn with the atoms."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms
from scipy.spatial.transform import Rotation

from mdtrain.infer.calculator import MDTrainCalculator
from tests.helpers.models import evaluate, make_tensor_model, water_like


@pytest.mark.parametrize("kind", ["dipole", "polar"])
def test_calculator_gives_the_models_tensors(kind):
    model = make_tensor_model(kind).eval()
    coord, atype = water_like(3, None, seed=2)
    order = np.array([3, 0, 4, 1, 5, 2, 6, 7, 8])  # not sorted by type
    atoms = Atoms(["O" if t == 0 else "H" for t in atype[order]], positions=coord[order])
    calc = MDTrainCalculator(model)
    label = model.label
    shape = (3,) if kind == "dipole" else (3, 3)
    direct = evaluate(model, coord[order], None, atype[order])
    got = calc.get_property(label, atoms)
    np.testing.assert_allclose(got, direct[label].reshape(shape), atol=1e-12)
    atomic = calc.get_property(f"atom_{label}", atoms)
    np.testing.assert_allclose(atomic, direct[f"atom_{label}"].reshape(-1, *shape), atol=1e-12)
    if kind == "dipole":
        atoms.calc = calc
        np.testing.assert_allclose(atoms.get_dipole_moment(), got, atol=1e-12)
    rot = Rotation.random(random_state=3).as_matrix()
    turned = atoms.copy()
    turned.positions = atoms.positions @ rot
    again = MDTrainCalculator(model).get_property(label, turned)
    want = got @ rot if kind == "dipole" else rot.T @ got @ rot
    np.testing.assert_allclose(again, want, atol=1e-11)
