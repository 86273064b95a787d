"""Symmetries of the energy model: translation, rotation, permutation, supercells, cutoff."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.models import evaluate, make_model, triclinic, water_like


@pytest.fixture(scope="module")
def model():
    return make_model({"sel": [16, 32]}).eval()


@pytest.fixture(scope="module")
def frame():
    box = triclinic(5.4, seed=11)
    coord, atype = water_like(4, box, seed=11)
    return coord, box, atype


def random_rotation(seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def test_translation(model, frame):
    coord, box, atype = frame
    ref = evaluate(model, coord, box, atype)
    moved = evaluate(model, coord + np.array([3.3, -7.1, 12.9]), box, atype)
    assert moved["energy"] == pytest.approx(ref["energy"], abs=1e-10)
    np.testing.assert_allclose(moved["force"], ref["force"], atol=1e-10)
    np.testing.assert_allclose(moved["virial"], ref["virial"], atol=1e-10)


@pytest.mark.parametrize("periodic", [True, False])
def test_rotation(model, frame, periodic):
    coord, box, atype = frame
    box = box if periodic else None
    rot = random_rotation(3)
    ref = evaluate(model, coord, box, atype)
    out = evaluate(model, coord @ rot, None if box is None else box @ rot, atype)
    assert out["energy"] == pytest.approx(ref["energy"], abs=1e-10)
    np.testing.assert_allclose(out["force"], ref["force"] @ rot, atol=1e-10)
    np.testing.assert_allclose(out["virial"], rot.T @ ref["virial"] @ rot, atol=1e-10)
    np.testing.assert_allclose(ref["virial"], ref["virial"].T, atol=1e-10)


def test_wrapping_atoms_into_the_cell_changes_nothing(model, frame):
    coord, box, atype = frame
    moved = coord + np.array([2, -1, 3]) @ box * np.array([[1], [0], [1]] * 4)[: len(coord)]
    ref = evaluate(model, coord, box, atype)
    out = evaluate(model, moved, box, atype)
    assert out["energy"] == pytest.approx(ref["energy"], abs=1e-10)
    np.testing.assert_allclose(out["force"], ref["force"], atol=1e-10)
    np.testing.assert_allclose(out["virial"], ref["virial"], atol=1e-10)


@pytest.mark.parametrize("type_one_side", [True, False])
def test_permutation(frame, type_one_side):
    model = make_model({"sel": [16, 32], "type_one_side": type_one_side}).eval()
    coord, box, atype = frame
    ref = evaluate(model, coord, box, atype)
    rng = np.random.default_rng(0)
    # same-type shuffle, then a full shuffle that mixes the type order
    same = np.concatenate([rng.permutation(np.flatnonzero(atype == t)) for t in (0, 1)])
    for perm in (same, rng.permutation(len(atype))):
        out = evaluate(model, coord[perm], box, atype[perm])
        assert out["energy"] == pytest.approx(ref["energy"], abs=1e-10)
        np.testing.assert_allclose(out["atom_energy"], ref["atom_energy"][perm], atol=1e-10)
        np.testing.assert_allclose(out["force"], ref["force"][perm], atol=1e-10)
        np.testing.assert_allclose(out["virial"], ref["virial"], atol=1e-10)


def test_supercell_is_extensive(model, frame):
    coord, box, atype = frame
    ref = evaluate(model, coord, box, atype)
    shifts = np.array([[i, j, k] for i in range(2) for j in range(2) for k in range(2)])
    big = np.concatenate([coord + s @ box for s in shifts])
    out = evaluate(model, big, 2 * box, np.tile(atype, 8))
    assert out["energy"] == pytest.approx(8 * ref["energy"], rel=1e-12)
    np.testing.assert_allclose(out["force"], np.tile(ref["force"], (8, 1)), atol=1e-10)
    np.testing.assert_allclose(out["virial"], 8 * ref["virial"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("type_one_side", [True, False])
def test_energy_smooth_across_cutoff(type_one_side):
    """A neighbour leaving the cutoff turns a real slot into a padded one without a jump."""
    model = make_model({"type_one_side": type_one_side}).eval()
    rcut = model.rcut
    direction = np.array([0.48, 0.6, 0.64])

    def energy(r: float) -> float:
        coord = np.array([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]])
        coord[1] += r * direction
        return float(evaluate(model, coord, None, np.array([0, 1]))["energy"])

    inside, outside = energy(rcut - 1e-6), energy(rcut + 1e-6)
    assert abs(inside - outside) < 1e-12
    assert outside == energy(50.0)  # beyond the cutoff: exactly the isolated atoms
    # the slope vanishes at the cutoff (C² switch), yet the neighbour matters further in
    assert abs((energy(rcut - 1e-4) - energy(rcut - 2e-4)) / 1e-4) < 1e-6
    assert abs(energy(rcut - 1.0) - outside) > 1e-6
