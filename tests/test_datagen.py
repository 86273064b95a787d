"""The test-data generator: pair-potential labels checked against ASE and finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms
from ase.calculators.morse import MorsePotential
from ase.stress import voigt_6_to_full_3x3_stress

from tests.helpers.datagen import default_pair_params, lj_labels, random_water_like


def _energy(coord, types, box, rcut):
    return lj_labels(coord[None], types, None if box is None else box[None], rcut)[0][0]


def test_single_type_matches_ase_morse():
    rng = np.random.default_rng(3)
    cell = np.array([[5.0, 0.0, 0.0], [0.8, 5.2, 0.0], [-0.5, 0.6, 4.9]])
    frac = rng.uniform(size=(12, 3))
    coord = frac @ cell
    params = {"epsilon": np.array([[0.3]]), "r0": np.array([[1.6]]), "rho0": np.array([[4.0]])}
    energy, force, virial = lj_labels(
        coord[None],
        np.zeros(12, int),
        cell[None],
        rcut=2.7 * 1.6,
        rcut_smth=1.9 * 1.6,
        params=params,
    )
    atoms = Atoms("X12", positions=coord, cell=cell, pbc=True)
    atoms.calc = MorsePotential(epsilon=0.3, r0=1.6, rho0=4.0)
    assert energy[0] == pytest.approx(atoms.get_potential_energy(), rel=1e-10)
    np.testing.assert_allclose(force[0], atoms.get_forces(), atol=1e-10)
    stress = voigt_6_to_full_3x3_stress(atoms.get_stress())
    np.testing.assert_allclose(virial[0], -stress * atoms.get_volume(), atol=1e-10)


@pytest.mark.parametrize("triclinic", [False, True])
def test_forces_and_virial_are_derivatives(triclinic):
    coords, types, boxes = random_water_like(1, 8, 6.4, seed=5, triclinic=triclinic)
    coord, box, rcut = coords[0], boxes[0], 4.0  # rcut > half the cell: several images
    energy, force, virial = lj_labels(coords, types, boxes, rcut)
    assert np.abs(force).max() > 0.1 and np.abs(virial).max() > 0.1
    h = 1e-5
    for atom, axis in [(0, 0), (1, 2), (5, 1), (23, 0)]:
        plus, minus = coord.copy(), coord.copy()
        plus[atom, axis] += h
        minus[atom, axis] -= h
        fd = -(_energy(plus, types, box, rcut) - _energy(minus, types, box, rcut)) / (2 * h)
        assert force[0, atom, axis] == pytest.approx(fd, abs=1e-6)
    # W = -dE/dε for r → r(1 + ε), cell strained with the positions
    fd_virial = np.zeros((3, 3))
    for a in range(3):
        for b in range(3):
            strain = np.zeros((3, 3))
            strain[a, b] = h
            e_plus = _energy(coord @ (np.eye(3) + strain), types, box @ (np.eye(3) + strain), rcut)
            e_minus = _energy(coord @ (np.eye(3) - strain), types, box @ (np.eye(3) - strain), rcut)
            fd_virial[a, b] = -(e_plus - e_minus) / (2 * h)
    np.testing.assert_allclose(virial[0], fd_virial, atol=1e-6)
    np.testing.assert_allclose(virial[0], virial[0].T, atol=1e-12)
    assert energy[0] == pytest.approx(_energy(coord, types, box, rcut))


def test_nopbc_labels_are_translation_invariant():
    coords, types, _ = random_water_like(1, 4, 6.0, seed=2)
    e1, f1, _ = lj_labels(coords, types, None, 4.0)
    e2, f2, _ = lj_labels(coords + 100.0, types, None, 4.0)
    assert e1[0] == pytest.approx(e2[0], abs=1e-12)
    np.testing.assert_allclose(f1, f2, atol=1e-12)
    np.testing.assert_allclose(f1[0].sum(axis=0), 0.0, atol=1e-12)  # Newton's third law


def test_default_params_are_symmetric():
    params = default_pair_params(3)
    for value in params.values():
        np.testing.assert_array_equal(value, value.T)
