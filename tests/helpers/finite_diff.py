"""Forces and virials by central finite differences of a model's energy (the neighbour list
rebuilt for each displaced frame), for comparison with the model's own derivatives."""

from __future__ import annotations

import numpy as np

from tests.helpers.models import energy_of, strained

H = 1e-5


def fd_forces(model, coord, box, atype, h: float = H) -> np.ndarray:
    forces = np.zeros_like(coord)
    for i in range(len(coord)):
        for k in range(3):
            plus, minus = coord.copy(), coord.copy()
            plus[i, k] += h
            minus[i, k] -= h
            e_p = energy_of(model, plus, box, atype)
            e_m = energy_of(model, minus, box, atype)
            forces[i, k] = -(e_p - e_m) / (2 * h)
    return forces


def fd_virial(model, coord, box, atype, h: float = H) -> np.ndarray:
    """virial[k][j] = -dE/d eps[j][k] with r' = r (I + eps) applied to coordinates and cell."""
    dE = np.zeros((3, 3))
    for a in range(3):
        for b in range(3):
            eps = np.zeros((3, 3))
            eps[a, b] = h
            e_p = energy_of(model, *strained(coord, box, eps), atype)
            e_m = energy_of(model, *strained(coord, box, -eps), atype)
            dE[a, b] = (e_p - e_m) / (2 * h)
    return -dE.T


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
