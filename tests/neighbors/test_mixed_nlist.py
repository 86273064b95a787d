"""The type-mixed neighbour list against a brute-force search over periodic images."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mdtrain.neighbors.mixed_nlist import build_mixed_nlist


def brute_force(coord: np.ndarray, box: np.ndarray | None, rcut: float, sel: int):
    """Every image within rcut, sorted by (distance, neighbour, shift); the first sel kept."""
    natoms = len(coord)
    if box is None:
        images = [np.zeros(3, dtype=np.int64)]
    else:
        heights = 1.0 / np.linalg.norm(np.linalg.inv(box), axis=0)  # plane spacings
        reach = np.ceil(rcut / heights).astype(int) + 4  # atoms may sit up to 3 cells out
        images = [np.array(n) for n in itertools.product(*(range(-k, k + 1) for k in reach))]
    nlist = np.full((natoms, sel), -1)
    shift = np.zeros((natoms, sel, 3), dtype=np.int64)
    counts = np.zeros(natoms, dtype=np.int64)
    for i in range(natoms):
        found = []
        for j in range(natoms):
            for n in images:
                if j == i and not n.any():
                    continue
                d = np.linalg.norm(coord[j] + (0 if box is None else n @ box) - coord[i])
                if d < rcut:
                    found.append((d, j, *n))
        found.sort()
        counts[i] = len(found)
        for slot, (_, j, *n) in enumerate(found[:sel]):
            nlist[i, slot], shift[i, slot] = j, n
    return nlist, shift, counts


def slot_distances(coord, box, nlist, shift) -> np.ndarray:
    image = 0.0 if box is None else shift @ box
    return np.linalg.norm(coord[np.clip(nlist, 0, None)] + image - coord[:, None], axis=-1)


@pytest.mark.parametrize(
    ("natoms", "box", "rcut", "sel"),
    [
        (9, np.array([[4.0, 0.0, 0.0], [1.1, 3.6, 0.0], [-0.7, 0.9, 3.3]]), 3.0, 12),  # truncated
        (3, np.array([[2.2, 0.0, 0.0], [0.5, 2.4, 0.0], [0.3, -0.6, 2.1]]), 3.1, 90),  # padded
        (7, None, 2.5, 5),
    ],
)
def test_mixed_nlist_equals_brute_force(natoms: int, box, rcut: float, sel: int) -> None:
    rng = np.random.default_rng(natoms)
    if box is None:
        coord = rng.random((natoms, 3)) * 4.0
        coord[-1] += 20.0  # alone: an atom without neighbours
    else:
        coord = rng.random((natoms, 3)) @ box + rng.integers(-2, 3, (natoms, 3)) @ box
    nlist, shift, counts = build_mixed_nlist(coord, box, rcut, sel)
    want_nlist, want_shift, want_counts = brute_force(coord, box, rcut, sel)
    assert np.array_equal(counts, want_counts)
    assert np.array_equal(nlist == -1, want_nlist == -1)
    # the same neighbours, in the same order up to rounding ties (an atom's images at ±n are
    # equally far, to the last bit or two of the library's distances)
    for i in range(natoms):
        assert sorted(zip(nlist[i], map(tuple, shift[i]))) == sorted(
            zip(want_nlist[i], map(tuple, want_shift[i]))
        )
    dist = slot_distances(coord, box, nlist, shift)
    want = slot_distances(coord, box, want_nlist, want_shift)
    assert np.allclose(dist, want, rtol=0, atol=1e-12)
    assert (np.diff(np.where(nlist >= 0, dist, 1e9), axis=1) >= -1e-12).all()
    assert (counts > sel).any() or (nlist == -1).any()
