"""Symmetries of the dipole and polar models: a rotated frame gives the rotated dipole
``mu R`` and polarizability ``Rᵀ alpha R`` (row vectors: r' = r R), atom by atom; a
translated frame and a permutation of atoms of one type change nothing (the permuted
atomic tensors follow their atoms); excluded types give exactly zero."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from tests.helpers.models import (
    TENSOR_DESCRIPTORS,
    evaluate,
    make_tensor_model,
    triclinic,
    water_like,
)

KINDS = [("dipole", {}), ("polar", {"fit_diag": False}), ("polar", {"fit_diag": True})]
DESCRIPTORS = list(TENSOR_DESCRIPTORS)


def _tensors(model, coord, box, atype):
    out = evaluate(model, coord, box, atype)
    atomic = out[f"atom_{model.label}"]
    shape = (len(atype), 3) if model.label == "dipole" else (len(atype), 3, 3)
    return atomic.reshape(shape), out[model.label]


def _rotate(t: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """Per-atom vectors (N, 3) -> t R; matrices (N, 3, 3) -> Rᵀ t R."""
    if t.ndim == 2:
        return t @ rot
    return np.einsum("ji,njk,kl->nil", rot, t, rot)


@pytest.mark.parametrize("descriptor", DESCRIPTORS)
@pytest.mark.parametrize("periodic", [True, False])
@pytest.mark.parametrize(("kind", "fit"), KINDS)
def test_rotated_frame_gives_rotated_tensors(kind, fit, periodic, descriptor):
    model = make_tensor_model(kind, descriptor=descriptor, **fit)
    box = triclinic(6.0, seed=1) if periodic else None
    coord, atype = water_like(4, box, seed=3)
    rot = Rotation.random(random_state=7).as_matrix()
    atomic, _ = _tensors(model, coord, box, atype)
    turned, total = _tensors(model, coord @ rot, None if box is None else box @ rot, atype)
    assert np.abs(atomic).max() > 1e-2
    np.testing.assert_allclose(turned, _rotate(atomic, rot), rtol=0, atol=1e-11)
    np.testing.assert_allclose(total.reshape(turned.shape[1:]), turned.sum(0), atol=1e-12)


@pytest.mark.parametrize("descriptor", DESCRIPTORS)
@pytest.mark.parametrize(("kind", "fit"), KINDS)
def test_translation_and_permutation_change_nothing(kind, fit, descriptor):
    model = make_tensor_model(kind, descriptor=descriptor, **fit)
    box = triclinic(6.0, seed=2)
    coord, atype = water_like(4, box, seed=4)
    atomic, total = _tensors(model, coord, box, atype)
    moved, moved_total = _tensors(model, coord + np.array([0.7, -2.1, 5.3]), box, atype)
    np.testing.assert_allclose(moved, atomic, atol=1e-11)
    perm = np.concatenate([[2, 0, 3, 1], 4 + np.random.default_rng(0).permutation(8)])
    swapped, swapped_total = _tensors(model, coord[perm], box, atype[perm])
    np.testing.assert_allclose(swapped, atomic[perm], atol=1e-11)
    np.testing.assert_allclose(swapped_total, total, atol=1e-11)
    np.testing.assert_allclose(moved_total, total, atol=1e-11)


@pytest.mark.parametrize("descriptor", DESCRIPTORS)
@pytest.mark.parametrize("kind", ["dipole", "polar"])
def test_types_outside_sel_type_give_zero(kind, descriptor):
    model = make_tensor_model(kind, descriptor=descriptor, sel_type=[0])
    assert model.sel_type() == [0]
    coord, atype = water_like(3, None, seed=5)
    atomic, total = _tensors(model, coord, None, atype)
    assert np.all(atomic[atype == 1] == 0) and np.abs(atomic[atype == 0]).min() > 0
    np.testing.assert_allclose(total.reshape(atomic.shape[1:]), atomic.sum(0), atol=1e-12)
