"""`nlist.pair_order`, the fast sort of a frame's pairs (packed keys, else plain sorts), against
the full ``np.lexsort`` of all its keys: on real frames, on pairs with many equal distances,
and on a perfect lattice."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.neighbors.nlist import Pairs, neighbor_pairs, pair_order
from mdtrain.neighbors.slots import _keyed_order


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


def test_packed_key_order_decides_real_frames_and_equals_the_lexsort():
    rng = np.random.default_rng(9)
    cell = np.diag([9.0, 10.0, 11.0]) + rng.uniform(-0.5, 0.5, (3, 3))
    pairs = neighbor_pairs(rng.uniform(0, 9, (150, 3)), cell, 4.0)
    group = pairs.i * 2 + rng.integers(0, 2, 150)[pairs.j]
    keyed = _keyed_order(group, pairs.dist)
    assert keyed is not None  # the fast path is the one taken on such frames
    np.testing.assert_array_equal(keyed, _lexsort(pairs, group))


def test_pairs_of_one_group_within_one_quantum_are_left_to_the_exact_sorts():
    """Distances one ulp apart (and equal ones) share a quantum: the packed keys cannot
    order them, so the plain sorts do; the order is the lexsort's either way."""
    d = 2.5
    dist = np.array([3.0, d, np.nextafter(d, 0.0), 1.0, d, 0.5])
    pairs = Pairs(
        i=np.array([0, 0, 0, 1, 0, 1]),
        j=np.array([4, 3, 1, 2, 0, 5]),
        shift=np.zeros((6, 3), np.int64),
        dist=dist,
    )
    assert _keyed_order(pairs.i, pairs.dist) is None
    np.testing.assert_array_equal(pair_order(pairs, pairs.i), _lexsort(pairs, pairs.i))
    apart = Pairs(pairs.i[:4], pairs.j[:4], pairs.shift[:4], np.array([3.0, 2.5, 2.0, 1.0]))
    np.testing.assert_array_equal(_keyed_order(apart.i, apart.dist), [2, 1, 0, 3])


def test_packed_keys_give_way_when_the_bits_run_out():
    rng = np.random.default_rng(2)
    pairs = _random_pairs(rng, 300, 10, 10**9)
    assert _keyed_order(pairs.i + 2**45, pairs.dist) is None  # groups need 46 bits
    assert _keyed_order(pairs.i, np.zeros(300)) is None  # no distance to quantise


def test_packed_keys_give_way_on_degenerate_distances():
    pairs = Pairs(np.array([0, 0, 1]), np.array([1, 2, 0]), np.zeros((3, 3), np.int64),
                  np.array([0.0, 1e-300, np.nan]))  # fmt: skip
    assert _keyed_order(pairs.i, pairs.dist) is None  # not finite
    tiny = np.array([0.0, 1e-300, 5e-301])  # levels / largest overflows
    assert _keyed_order(pairs.i, tiny) is None
    tied = Pairs(pairs.i, pairs.j, pairs.shift, tiny)
    np.testing.assert_array_equal(pair_order(tied, tied.i), _lexsort(tied, tied.i))
