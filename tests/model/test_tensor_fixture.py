"""Dipole and polar models written by DeePMD-kit's numpy implementation (the committed
fixtures of ``tests/fixtures/deepmd/``, made by ``make_tensor_fixture.py``), read by mdtrain
and evaluated on the frames stored beside them: atomic and global tensors equal DeePMD-kit's
to 1e-10 relative (float64). Written back, the dict reads again to the same numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mdtrain.model.deepmd_file import read_dp
from mdtrain.model.tensor_deepmd import load_tensor_model, tensor_model_to_deepmd
from tests.helpers.deepmd import rel_diff
from tests.helpers.models import evaluate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepmd"
# dipole: type_one_side, atom_exclude_types [1]; polar_full: fit_diag false, two-side
# embeddings, atom_exclude_types [1]; polar_diag: fit_diag, no exclusion. All with random
# bias_atom_e, scale [0.7, 1.3], constant_matrix and out_bias.
VARIANTS = ["dipole_one_side", "polar_full", "polar_diag"]
GROUPS = ["periodic", "cluster"]


def _worst(model, ref) -> dict:
    label = model.label
    worst = {}
    for group in GROUPS:
        coord, atype = ref[f"{group}_coord"], ref[f"{group}_atype"]
        box = ref.get(f"{group}_box")
        out = [
            evaluate(model, c, None if box is None else box[f], atype) for f, c in enumerate(coord)
        ]
        atomic = np.stack([o[f"atom_{label}"] for o in out])
        total = np.stack([o[label] for o in out])
        worst[(group, "atomic")] = rel_diff(atomic, ref[f"{group}_atomic"])
        worst[(group, "global")] = rel_diff(total, ref[f"{group}_global"])
    return worst


def test_fixtures_are_small():
    total = sum((FIXTURES / f"{v}{s}").stat().st_size for v in VARIANTS for s in (".dp", ".npz"))
    assert total < 150_000


@pytest.mark.parametrize("variant", VARIANTS)
def test_deepmd_numpy_tensor_model_gives_deepmd_numbers(variant):
    model = load_tensor_model(read_dp(FIXTURES / f"{variant}.dp"), f"{variant}.dp")
    ref = np.load(FIXTURES / f"{variant}.npz")
    assert model.kind == variant.split("_")[0]
    assert np.abs(ref["periodic_global"]).max() > 0.01  # the comparison is not of zeros
    worst = _worst(model, ref)
    bad = {k: v for k, v in worst.items() if not v < 1e-10}
    assert not bad, f"relative differences to DeePMD-kit above 1e-10: {bad}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_written_dict_reads_back_to_the_same_numbers(variant):
    data = read_dp(FIXTURES / f"{variant}.dp")
    model = load_tensor_model(data, "fixture")
    again = load_tensor_model({"model": tensor_model_to_deepmd(model)}, "written")
    ref = np.load(FIXTURES / f"{variant}.npz")
    assert max(_worst(again, ref).values()) < 1e-10
    assert again.get_model_config() == model.get_model_config()
