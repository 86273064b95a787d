"""`nlist.pair_order`, the fast sort of a frame's pairs, against the full ``np.lexsort`` of
all its keys: on real frames, on pairs with many equal distances, and on a perfect lattice."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.neighbors.nlist import Pairs, neighbor_pairs, pair_order


def _lexsort(pairs: Pairs, group: np.ndarray) -> np.ndarray:
    s = pairs.shift
    return np.lexsort((s[:, 2], s[:, 1], s[:, 0], pairs.j, pairs.dist, group))


def _random_pairs(rng: np.random.Generator, n: int, natoms: int, distinct: int) -> Pairs:
    """Pairs whose distances take ``distinct`` values only (ties everywhere when small)."""
    return Pairs(
        i=rng.integers(0, natoms, n),
        j=rng.integers(0, natoms, n),
        shift=rng.integers(-1, 2, (n, 3)),
        dist=rng.integers(1, distinct + 1, n) * 0.5,
    )


@pytest.mark.parametrize("distinct", [3, 10**9])
@pytest.mark.parametrize("natoms", [7, 40000])  # groups within 16 bits, and beyond
def test_pair_order_is_the_full_lexicographic_order(distinct, natoms):
    rng = np.random.default_rng(distinct % 97 + natoms)
    pairs = _random_pairs(rng, 5000, natoms, distinct)
    types = rng.integers(0, 3, natoms)
    for group in (pairs.i, pairs.i * 3 + types[pairs.j]):
        np.testing.assert_array_equal(pair_order(pairs, group), _lexsort(pairs, group))


def test_pair_order_on_real_frames():
    rng = np.random.default_rng(4)
    cell = np.diag([9.0, 10.0, 11.0]) + rng.uniform(-0.5, 0.5, (3, 3))
    coord = rng.uniform(0, 9, (120, 3))
    types = rng.integers(0, 2, 120)
    lattice = np.stack(np.meshgrid(*[np.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3) * 2.0
    for xyz, box, rcut in (
        (coord, cell, 4.0),
        (lattice, np.eye(3) * 8.0, 4.5),
        (coord[:5], None, 9.0),
    ):
        pairs = neighbor_pairs(xyz, box, rcut)
        for group in (pairs.i, pairs.i * 2 + types[: len(xyz)][pairs.j]):
            np.testing.assert_array_equal(pair_order(pairs, group), _lexsort(pairs, group))


def test_pair_order_of_no_pairs():
    empty = Pairs(
        np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3), np.int64), np.zeros(0)
    )
    assert pair_order(empty, empty.i).shape == (0,)
