"""DOS and property models as DeePMD-kit's ``.dp`` dict and back: the fitting's layout as
DeePMD-kit writes it (``type`` dos/property, ``dim_out``, ``var_name`` = property_name,
``task_dim``, ``intensive``, ``distinguish_types``; one net per type after se_e2_a, one net
for all after dpa1, ``nets`` of ``ndim`` 1 or 0), ``out_bias``/``out_std``, and a model read
back giving the same outputs bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.infer.load import load_model
from mdtrain.model.deepmd_file import read_dp, write_dp
from tests.helpers.models import evaluate, make_invariant_model, water_like


@pytest.mark.parametrize("case", ["dos", "property", "property-dpa1"])
def test_dp_round_trip_keeps_layout_and_outputs(tmp_path, case):
    model = make_invariant_model(case).eval()
    write_dp(model, tmp_path / "m.dp")
    data = read_dp(tmp_path / "m.dp")
    fit = data["model"]["fitting"]
    shared = case.endswith("dpa1")
    assert fit["type"] == model.kind and fit["dim_out"] == model.width
    assert fit["mixed_types"] is shared and fit["nets"]["ndim"] == (0 if shared else 1)
    assert len(fit["nets"]["networks"]) == (1 if shared else model.ntypes)
    if model.kind == "property":
        assert fit["var_name"] == "gap" and fit["task_dim"] == model.width
        assert fit["intensive"] is model.intensive and fit["distinguish_types"] is True
    stats = data["model"]["@variables"]
    np.testing.assert_array_equal(stats["out_std"].reshape(model.out_std.shape), model.out_std)
    back = load_model(tmp_path / "m.dp")
    coord, atype = water_like(3, None, seed=4)
    ours, theirs = evaluate(model, coord, None, atype), evaluate(back, coord, None, atype)
    for key in ours:
        np.testing.assert_array_equal(theirs[key], ours[key])
