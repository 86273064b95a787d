"""Models written by DeePMD-kit itself, read by mdtrain: the committed fixtures of
``tests/fixtures/deepmd/`` (made by its ``make_fixture.py`` with ``dp --tf train``, ``dp
freeze`` and ``dp convert-backend``) give the energies, atom energies, forces and virials
that DeePMD-kit's ``DeepPot`` gave for the same frames, stored beside them. No DeePMD-kit
needed: this guards the ``.dp`` format in the default suite (the live comparison is the
``interop`` tier, tests/interop/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mdtrain.infer.load import load_model
from tests.helpers.deepmd import rel_diff
from tests.helpers.models import evaluate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepmd"
# one_side: type_one_side, tanh everywhere; two_side: type_one_side false, resnet_dt
# embedding nets, exclude_types [[1, 1]], gelu fitting nets (DeePMD's tanh approximation)
VARIANTS = ["se_e2_a_one_side", "se_e2_a_two_side"]
GROUPS = ["water", "triclinic", "cluster"]  # 24 atoms; 3 atoms in a cell < rcut; no cell


def test_fixtures_are_present_and_small():
    for variant in VARIANTS:
        for suffix in (".dp", ".npz"):
            path = FIXTURES / f"{variant}{suffix}"
            assert path.is_file() and path.stat().st_size < 200_000, path


@pytest.mark.parametrize("variant", VARIANTS)
def test_deepmd_written_model_gives_deepmd_numbers(variant):
    model = load_model(FIXTURES / f"{variant}.dp")
    ref = np.load(FIXTURES / f"{variant}.npz")
    assert list(model.type_map) == [str(t) for t in ref["type_map"]]
    assert float(model.rcut) == 4.0
    worst = {}
    for group in GROUPS:
        coord, atype = ref[f"{group}_coord"], ref[f"{group}_atype"]
        box = ref.get(f"{group}_box")
        out = [
            evaluate(model, c, None if box is None else box[f], atype) for f, c in enumerate(coord)
        ]
        for key in ("energy", "atom_energy", "force", "virial"):
            ours = np.stack([o[key] for o in out])
            worst[(group, key)] = rel_diff(ours, ref[f"{group}_{key}"])
    bad = {k: v for k, v in worst.items() if not v < 1e-10}
    assert not bad, f"relative differences to DeePMD-kit above 1e-10: {bad}"
