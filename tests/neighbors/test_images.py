"""The small-cell search (image replication, many frames at once) against a brute-force loop
over periodic images and against the compiled library: the same pairs, shifts and
distances on triclinic, strongly skewed and tiny cells (shorter than rcut: many images of
one neighbour, an atom's own images), and the same inputs for the statistics and the
training path's lists as the library gives."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.neighbors import images
from mdtrain.neighbors.nlist import NeighborSearch, build_nlist, neighbor_pairs
from mdtrain.neighbors.stat import compute_neighbor_stat
from mdtrain.neighbors.window import search_window
from tests.helpers.reference import (
    SMALL_CELLS,
    brute_force_pairs,
    random_cell,
    small_cell_frames,
)

RCUT = 4.0


def frames(case: str, seed: int, nframes: int = 3, natoms: int = 6):
    """Frames of one cell shape (each frame its own strained cell), atoms partly outside."""
    return small_cell_frames(np.random.default_rng(seed), case, nframes, natoms)


def rows(i, j, shift, dist) -> list[tuple]:
    return sorted((int(a), int(b), *map(int, s), float(d)) for a, b, s, d in
                  zip(i, j, shift, dist, strict=True))  # fmt: skip


def assert_same(got: list[tuple], want: list[tuple]) -> None:
    assert [g[:5] for g in got] == [w[:5] for w in want]
    np.testing.assert_allclose([g[5] for g in got], [w[5] for w in want], rtol=1e-12)


def mirrored(half: list[tuple]) -> list[tuple]:
    return sorted(half + [(j, i, -a, -b, -c, d) for i, j, a, b, c, d in half])


@pytest.mark.parametrize("case", sorted(SMALL_CELLS))
@pytest.mark.parametrize("seed", [0, 1])
def test_pairs_match_brute_force_and_the_library(case, seed):
    coords, boxes = frames(case, seed)
    assert images.small_cells([(coords, boxes)], RCUT)[0].all()  # this search takes them
    full = images.image_pairs(coords, boxes, RCUT, full=True, vectors=True)
    half = images.image_pairs(coords, boxes, RCUT, full=False, vectors=True)
    assert (np.diff(full[0]) >= 0).all() and (np.diff(half[0]) >= 0).all()  # by frame
    library = NeighborSearch(RCUT)
    for f in range(len(coords)):
        want = brute_force_pairs(coords[f], boxes[f], RCUT)
        ends = [(i, j) for i, j, *_ in want]
        assert len(set(ends)) < len(ends)  # some neighbour seen through several images
        got_full = rows(*(a[full[0] == f] for a in full[1:5]))
        got_half = rows(*(a[half[0] == f] for a in half[1:5]))
        assert_same(got_full, sorted(want))
        assert_same(mirrored(got_half), sorted(want))
        assert_same(got_full, rows(*library.compute(coords[f], boxes[f], True, True)))
        assert len(got_half) == len(library.compute(coords[f], boxes[f], False)[0])
    for frame, i, j, shift, dist, vec in (full, half):
        # vectors as the model forms them: coord[j] - coord[i] + shift @ box
        formed = coords[frame, j] - coords[frame, i] + np.einsum("pa,pab->pb", shift, boxes[frame])
        np.testing.assert_allclose(vec, formed, rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.linalg.norm(vec, axis=1), dist, rtol=1e-14)


def test_frames_of_different_cell_sizes_in_one_call():
    """Frames whose cells need different numbers of images are searched in groups and handed
    back in frame order."""
    parts = [frames(case, 3, nframes=2) for case in ("tiny", "triclinic", "tiny", "skewed")]
    coords = np.concatenate([c for c, _ in parts])
    boxes = np.concatenate([b for _, b in parts])
    frame, i, j, shift, dist, _ = images.image_pairs(coords, boxes, RCUT, full=True)
    assert (np.diff(frame) >= 0).all()
    for f in range(len(coords)):
        k = frame == f
        assert_same(rows(i[k], j[k], shift[k], dist[k]), sorted(brute_force_pairs(
            coords[f], boxes[f], RCUT)))  # fmt: skip


def test_no_pairs_and_no_frames():
    box = np.eye(3)[None] * 3.0
    frame, i, j, shift, dist, vec = images.image_pairs(np.zeros((1, 1, 3)), box, 2.9, vectors=True)
    assert len(frame) == len(i) == len(dist) == 0 and shift.shape == (0, 3) and vec.shape == (0, 3)
    frame, *_ = images.image_pairs(np.zeros((0, 4, 3)), np.zeros((0, 3, 3)), 2.0)
    assert len(frame) == 0


def test_which_frames_are_small_cells():
    cells = np.stack([np.eye(3) * 4.0, np.eye(3) * 20.0, np.diag([4.0, 4.0, 0.0]), np.eye(3)])
    coords = np.zeros((4, 2, 3))
    coords[3, 0, 0] = np.nan
    small, usable, counts = images.small_cells([(coords, cells)], 3.0)
    assert small.tolist() == [True, False, False, False]  # large, flat, not finite
    assert usable.tolist() == [True, True, False, False]
    assert counts[0].tolist() == [2, 2, 2]  # 2·3/4 = 1.5: at most 2 images per axis
    big = np.zeros((1, 50, 3))  # 50² atoms × 8 images: past MAX_CANDIDATES
    assert not images.small_cells([(big, cells[:1])], 3.0)[0][0]


def test_window_equals_the_library_frame_by_frame():
    """`window.search_window` over batches of every kind: small cells (this search), a large
    cell and a cluster (the library), frames it cannot search (None)."""
    rng = np.random.default_rng(5)
    tiny, tiny_boxes = frames("tiny", 4, nframes=2, natoms=3)
    mid, mid_boxes = frames("triclinic", 5, nframes=3, natoms=6)
    large_boxes = np.stack([random_cell(rng, (12.0, 13.0, 11.0)) for _ in range(2)])
    large = np.einsum("fai,fij->faj", rng.uniform(0, 1, size=(2, 20, 3)), large_boxes)
    cluster = rng.uniform(0, 5.0, size=(2, 5, 3))
    broken = mid.copy()
    broken[1, 2, 0] = np.inf
    flat_boxes = mid_boxes.copy()
    flat_boxes[0, 2] = flat_boxes[0, 0] + flat_boxes[0, 1]  # no volume
    batches = [(tiny, tiny_boxes), (large, large_boxes), (cluster, None), (mid, mid_boxes),
               (broken, mid_boxes), (mid, flat_boxes)]  # fmt: skip
    library = NeighborSearch(RCUT, small_cells=False)
    for search in (NeighborSearch(RCUT), library):
        pairs = search_window(search, batches, vectors=True)
        found = pairs.per_frame()
        assert pairs.sizes.tolist() == [0 if r is None else len(r[0]) for b in found for r in b]
        assert found[4][1] is None and found[5][0] is None  # not searched: the caller reports
        for b, (coords, boxes) in enumerate(batches):
            for f in range(len(coords)):
                if found[b][f] is None:
                    continue
                box = None if boxes is None else boxes[f]
                i, j, dist, vec = found[b][f]
                want_i, want_j, want_shift, want_dist = library.compute(coords[f], box, False)
                got = sorted(zip(i.tolist(), j.tolist(), np.round(dist, 9).tolist()))
                want = sorted(zip(want_i.tolist(), want_j.tolist(), np.round(want_dist, 9)))
                # the half list may hold either direction of a pair: compare unordered
                assert sorted((min(a, b), max(a, b), d) for a, b, d in got) == sorted(
                    (min(a, b), max(a, b), d) for a, b, d in want
                )
                np.testing.assert_allclose(np.linalg.norm(vec, axis=1), dist, rtol=1e-14)


def test_statistics_and_training_lists_equal_the_librarys(tmp_path, monkeypatch):
    """The neighbour statistics (which now search small cells together) and what their
    visitor hands the data statistics equal the library's; and the lists training builds
    (`build_nlist`, the library) hold the same pairs as this search's full list."""
    from mdtrain.data import open_system
    from tests.helpers.datagen import write_npy_system

    systems = []
    for k, case in enumerate(("tiny", "triclinic", "skewed", "slab")):
        coords, boxes = frames(case, 10 + k, nframes=3, natoms=4 + k)
        types = np.arange(4 + k) % 2
        path = write_npy_system(tmp_path / case, coords, types, ["O", "H"], boxes)
        systems.append(open_system(path, ["O", "H"]))

    def run(small_cells: bool):
        seen = {}
        original = NeighborSearch.__init__

        def init(self, rcut, threads=1, small=small_cells):
            original(self, rcut, threads, small)

        monkeypatch.setattr(NeighborSearch, "__init__", init)
        stat = compute_neighbor_stat(
            systems, RCUT, 2, progress=False,
            visit=lambda s, f, i, j, vec: seen.setdefault((s, f), (i, j, vec)),
        )  # fmt: skip
        return stat, seen

    fast, fast_seen = run(True)
    slow, slow_seen = run(False)
    assert fast.min_nbor_dist == pytest.approx(slow.min_nbor_dist, rel=1e-14)
    assert fast.max_nbor_size == slow.max_nbor_size
    assert [s.max_nbor_size for s in fast.systems] == [s.max_nbor_size for s in slow.systems]
    assert fast_seen.keys() == slow_seen.keys() and len(fast_seen) == 12
    for key, (i, j, vec) in fast_seen.items():
        si, sj, svec = slow_seen[key]

        def both(a, b, v):  # each pair from both ends, its vector rounded
            return sorted([(x, y, *np.round(w, 9)) for x, y, w in zip(a, b, v, strict=True)]
                          + [(y, x, *np.round(-w, 9)) for x, y, w in zip(a, b, v, strict=True)])  # fmt: skip

        assert both(i, j, vec) == both(si, sj, svec)
    # the training path's padded lists: the same pairs as this search's full list
    for system in systems:
        data = system.frames(np.arange(system.nframes))
        for f in range(system.nframes):
            coord, box = data["coord"][f], data["box"][f]
            nlist, shift, counts = build_nlist(coord, box, system.atype, RCUT, [60, 60])
            centre, slot = np.nonzero(nlist >= 0)
            listed = sorted(zip(centre.tolist(), nlist[centre, slot].tolist(),
                                map(tuple, shift[centre, slot].tolist())))  # fmt: skip
            frame, i, j, s, _, _ = images.image_pairs(coord[None], box[None], RCUT, full=True)
            assert listed == sorted(zip(i.tolist(), j.tolist(), map(tuple, s.tolist())))
            assert counts.sum() == len(i) == len(neighbor_pairs(coord, box, RCUT).i)
