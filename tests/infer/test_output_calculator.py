"""The ASE calculator of DOS and property models: ``get_property("dos")`` and
``get_property("<property_name>")`` are the model's outputs, per atom in the ``Atoms``' own
order."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms

from mdtrain.infer.calculator import MDTrainCalculator
from tests.helpers.models import evaluate, make_invariant_model, water_like


@pytest.mark.parametrize("case", ["dos", "intensive"])
def test_calculator_gives_the_models_outputs(case):
    model = make_invariant_model(case).eval()
    coord, atype = water_like(3, None, seed=2)
    order = np.array([3, 0, 4, 1, 5, 2, 6, 7, 8])  # not sorted by type
    atoms = Atoms(["O" if t == 0 else "H" for t in atype[order]], positions=coord[order])
    calc = MDTrainCalculator(model)
    direct = evaluate(model, coord[order], None, atype[order])
    name = model.output
    np.testing.assert_allclose(calc.get_property(name, atoms), direct[name], atol=1e-12)
    atomic = calc.get_property(f"atom_{name}", atoms)
    assert atomic.shape == (len(atoms), model.width)
    np.testing.assert_allclose(atomic, direct[f"atom_{name}"], atol=1e-12)
