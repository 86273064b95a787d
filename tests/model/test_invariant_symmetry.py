"""Symmetries of the DOS and property models: a rotated, translated or permuted frame gives
the same atomic outputs (following their atoms) and the same frame output; the frame output
is the sum of the atomic ones (the mean for an intensive property); excluded types give zero;
the output statistics enter as DeePMD-kit's ``apply_out_stat`` says (DOS: + bias; property:
x std + bias, per type or type 0's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial.transform import Rotation

from tests.helpers.models import (
    INVARIANT_CASES,
    evaluate,
    make_invariant_model,
    triclinic,
    water_like,
)

CASES = INVARIANT_CASES


def _outputs(model, coord, box, atype):
    out = evaluate(model, coord, box, atype)
    return out[f"atom_{model.output}"], out[model.output]


@pytest.mark.parametrize("case", list(CASES))
def test_rotation_translation_permutation_change_nothing(case):
    model = make_invariant_model(case)
    box = triclinic(6.0, seed=1)
    coord, atype = water_like(4, box, seed=3)
    atomic, total = _outputs(model, coord, box, atype)
    assert np.abs(atomic).max() > 1e-2
    rot = Rotation.random(random_state=7).as_matrix()
    turned, turned_total = _outputs(model, coord @ rot, box @ rot, atype)
    np.testing.assert_allclose(turned, atomic, atol=1e-10)
    moved, moved_total = _outputs(model, coord + np.array([0.7, -2.1, 5.3]), box, atype)
    np.testing.assert_allclose(moved, atomic, atol=1e-10)
    perm = np.concatenate([[2, 0, 3, 1], 4 + np.random.default_rng(0).permutation(8)])
    swapped, swapped_total = _outputs(model, coord[perm], box, atype[perm])
    np.testing.assert_allclose(swapped, atomic[perm], atol=1e-10)
    for other in (turned_total, moved_total, swapped_total):
        np.testing.assert_allclose(other, total, atol=1e-10)
    reduce = atomic.mean(0) if model.intensive else atomic.sum(0)
    np.testing.assert_allclose(total, reduce, atol=1e-12)


@pytest.mark.parametrize("case", ["dos", "property"])
def test_statistics_enter_as_deepmd_applies_them(case):
    model = make_invariant_model(case)
    coord, atype = water_like(3, None, seed=5)
    atomic, _ = _outputs(model, coord, None, atype)
    with torch.no_grad():
        model.out_bias.zero_()
        model.out_std.fill_(1.0)
    raw, _ = _outputs(model, coord, None, atype)
    m = make_invariant_model(case)  # the same random statistics again
    bias, std = m.out_bias.numpy()[atype], m.out_std.numpy()[atype]
    want = raw + bias if case == "dos" else raw * std + bias
    np.testing.assert_allclose(atomic, want, atol=1e-12)


def test_type_blind_statistics_use_type_0():
    model = make_invariant_model("property")
    model.distinguish_types = False
    coord, atype = water_like(3, None, seed=6)
    atomic, _ = _outputs(model, coord, None, atype)
    with torch.no_grad():
        bias, std = model.out_bias.clone(), model.out_std.clone()
        model.out_bias.zero_()
        model.out_std.fill_(1.0)
    raw, _ = _outputs(model, coord, None, atype)
    np.testing.assert_allclose(atomic, raw * std[0].numpy() + bias[0].numpy(), atol=1e-12)


def test_excluded_types_give_zero_and_leave_the_mean():
    model = make_invariant_model("intensive", atom_exclude_types=[1])
    coord, atype = water_like(3, None, seed=5)
    atomic, total = _outputs(model, coord, None, atype)
    assert np.all(atomic[atype == 1] == 0) and np.abs(atomic[atype == 0]).min() > 0
    np.testing.assert_allclose(total, atomic[atype == 0].mean(0), atol=1e-12)
