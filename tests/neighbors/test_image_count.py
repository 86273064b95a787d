"""The small-cell counting of the neighbour statistics (`image_count.neighbor_counts`: each
pair's images counted, not listed) against a brute-force loop over periodic images, and
against the listing search it stands in for (`images.image_pairs`): the same counts per atom
and type, the same number of pairs, and each frame's shortest distance bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.neighbors import images
from mdtrain.neighbors.image_count import neighbor_counts
from mdtrain.neighbors.nlist import NeighborSearch
from mdtrain.neighbors.window import search_window
from tests.helpers.reference import (
    SMALL_CELLS,
    brute_force_pairs,
    random_cell,
    small_cell_frames,
)

RCUT = 4.0
NTYPES = 3


def frames(case: str, seed: int, nframes: int = 3, natoms: int = 6):
    """Frames of one cell shape (each frame its own strained cell), atoms partly outside,
    and random atom types per frame."""
    rng = np.random.default_rng(seed)
    coords, boxes = small_cell_frames(rng, case, nframes, natoms)
    return coords, boxes, rng.integers(0, NTYPES, size=(nframes, natoms))


def brute_force_counts(coord, box, types, rcut=RCUT):
    """Each atom's neighbours of each type, and the shortest distance, by enumeration."""
    counts = np.zeros((len(coord), NTYPES), dtype=np.int64)
    lowest = np.inf
    for i, j, *_, dist in brute_force_pairs(coord, box, rcut):
        counts[i, types[j]] += 1
        lowest = min(lowest, dist)
    return counts, lowest


def assert_as_listed(coords, boxes, types, counts, npairs, lowest, rcut=RCUT):
    """The counts of the listing search, its number of half-list pairs, its distances."""
    frame, i, j, _, dist, _ = images.image_pairs(coords, boxes, rcut, shifts=False)
    for f in range(len(coords)):
        k = frame == f
        listed = np.zeros((coords.shape[1], NTYPES), dtype=np.int64)
        np.add.at(listed, (i[k], types[f, j[k]]), 1)  # a half-list pair is seen by both ends
        np.add.at(listed, (j[k], types[f, i[k]]), 1)
        assert (counts[f] == listed).all()
        assert npairs[f] == k.sum()
        assert lowest[f] == (dist[k].min() if k.any() else np.inf)  # bit for bit


@pytest.mark.parametrize("case", sorted(SMALL_CELLS))
@pytest.mark.parametrize("seed", [0, 1])
def test_counts_match_brute_force_and_the_listing(case, seed):
    coords, boxes, types = frames(case, seed)
    assert images.small_cells([(coords, boxes)], RCUT)[0].all()  # the small-cell search's
    counts, npairs, lowest = neighbor_counts(coords, boxes, types, NTYPES, RCUT)
    assert counts.dtype == np.int64 and counts.shape == (len(coords), coords.shape[1], NTYPES)
    for f in range(len(coords)):
        want, want_lowest = brute_force_counts(coords[f], boxes[f], types[f])
        assert (counts[f] == want).all()
        assert npairs[f] * 2 == want.sum()  # the half list holds each pair once
        assert lowest[f] == pytest.approx(want_lowest, rel=1e-12)
    assert_as_listed(coords, boxes, types, counts, npairs, lowest)


def test_frames_of_different_cell_sizes_in_one_call():
    """Frames whose cells need different numbers of images are counted in groups and handed
    back in frame order."""
    parts = [frames(case, 3, nframes=2) for case in ("tiny", "triclinic", "tiny", "skewed")]
    coords, boxes, types = (np.concatenate([p[n] for p in parts]) for n in range(3))
    counts, npairs, lowest = neighbor_counts(coords, boxes, types, NTYPES, RCUT)
    for f in range(len(coords)):
        want, want_lowest = brute_force_counts(coords[f], boxes[f], types[f])
        assert (counts[f] == want).all() and lowest[f] == pytest.approx(want_lowest, rel=1e-12)
    assert_as_listed(coords, boxes, types, counts, npairs, lowest)


def test_distances_at_the_cutoff_are_decided_exactly():
    """Neighbours within a rounding margin of rcut (the few whose distance is computed, not
    judged from the squared lengths of the product): those just inside count, those just
    outside do not, as in the listing search."""
    box = np.diag([5.0, 5.5, 6.0])[None]
    coords = np.zeros((1, 4, 3))
    coords[0, 1, 0] = RCUT * (1.0 - 1e-12)  # inside, by less than the margin
    coords[0, 2, 1] = RCUT * (1.0 + 1e-12)  # outside, by less than the margin
    coords[0, 3] = [2.5, 2.75, 3.0]
    types = np.array([[0, 1, 2, 0]])
    counts, npairs, lowest = neighbor_counts(coords, box, types, NTYPES, RCUT)
    want, want_lowest = brute_force_counts(coords[0], box[0], types[0])
    assert (counts[0] == want).all() and want[0, 1] >= 1
    assert lowest[0] == pytest.approx(want_lowest, rel=1e-12)
    assert_as_listed(coords, box, types, counts, npairs, lowest)


def test_a_frame_without_pairs_and_no_frames():
    box = np.eye(3)[None] * 3.0
    counts, npairs, lowest = neighbor_counts(np.zeros((1, 1, 3)), box, np.zeros((1, 1), int),
                                             2, 2.9)  # fmt: skip
    assert counts.tolist() == [[[0, 0]]] and npairs.tolist() == [0] and lowest.tolist() == [np.inf]
    counts, npairs, lowest = neighbor_counts(np.zeros((0, 4, 3)), np.zeros((0, 3, 3)),
                                             np.zeros((0, 4), int), 2, 2.0)  # fmt: skip
    assert counts.shape == (0, 4, 2) and len(npairs) == len(lowest) == 0


def test_window_counts_small_cells_and_lists_the_rest():
    """`window.search_window` given the atom types: the small cells counted (per atom and
    type, each frame's number of pairs and shortest distance), a large cell and a cluster
    listed by the library, frames it cannot search reported as before."""
    rng = np.random.default_rng(7)
    tiny, tiny_boxes, tiny_types = frames("tiny", 4, nframes=2, natoms=3)
    large_boxes = np.stack([random_cell(rng, (12.0, 13.0, 11.0)) for _ in range(2)])
    large = np.einsum("fai,fij->faj", rng.uniform(0, 1, size=(2, 20, 3)), large_boxes)
    cluster = rng.uniform(0, 5.0, size=(2, 5, 3))
    broken = tiny.copy()
    broken[1, 2, 0] = np.nan
    batches = [(tiny, tiny_boxes), (large, large_boxes), (cluster, None), (broken, tiny_boxes)]
    types = [tiny_types[0], rng.integers(0, NTYPES, 20), rng.integers(0, NTYPES, 5),
             tiny_types[1]]  # fmt: skip
    search = NeighborSearch(RCUT)
    counted = search_window(search, batches, types=types, ntypes=NTYPES)
    listed = search_window(search, batches)
    assert counted.failed.keys() == listed.failed.keys() == {7}  # broken's second frame
    assert counted.sizes.tolist() == listed.sizes.tolist()
    frames_counted = np.concatenate([c.frames for c in counted.counted]).tolist()
    assert sorted(frames_counted) == [0, 1, 6]  # the small cells that could be searched
    for c in counted.counted:
        for f, count, low in zip(c.frames.tolist(), c.counts, c.lowest, strict=True):
            b = 0 if f < 2 else 3
            coords, boxes = batches[b]
            want, want_lowest = brute_force_counts(coords[f - 2 * b], boxes[f - 2 * b], types[b])
            assert (count == want).all() and low == pytest.approx(want_lowest, rel=1e-12)
    with pytest.raises(ValueError, match="not listed"):
        counted.per_frame()
