"""Neighbour counts of small periodic cells without listing the pairs, many frames in one
pass: what the neighbour statistics need of a frame is each atom's number of neighbours of
each type and the shortest distance, not every (pair, image) within rcut.

Why: for thousands of small cells, listing the pairs (`images.image_pairs`: every image of
every pair within rcut, its distance computed, then counted) cost most of a
``neighbor-stat`` run's search. Here the candidates are the same (`images.candidates`), but
for each pair only the number of its images within rcut is kept, and summed per atom and
type by one small product per frame.

How: the squared lengths of every candidate come from one matrix product for all the
frames of a pass, laid out images first (K, F, P), so that counting a pair's images is a sum
of whole planes. A candidate clearly shorter than rcut (`images.length_bounds`) counts as it
is; only the few within the rounding margin of rcut get their distance computed, as
`images.image_pairs` computes it, and count when it is below rcut (the squared lengths' own
rounding is far inside that margin, however they are summed). A frame's shortest distance
is computed the same way for the candidates within the margin of the frame's shortest
squared length. Both therefore equal what `images.image_pairs` gives, bit for bit.
"""

from __future__ import annotations

import numpy as np

from mdtrain.neighbors.images import (
    candidates,
    diagonal,
    length_bounds,
    pass_groups,
    upper_pairs,
)

_CANDIDATES_PER_PASS = 1 << 18  # (frame, pair, image) candidates evaluated together
_FAR = 1e300  # Å²: the squared length given to the candidates left out


def neighbor_counts(
    coords: np.ndarray, boxes: np.ndarray, types: np.ndarray, ntypes: int, rcut: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For frames ``coords`` (F, N, 3) in cells ``boxes`` (F, 3, 3) (with volume) of atoms
    of ``types`` (F, N) (< ``ntypes``): each atom's number of neighbours of each type within
    ``rcut``, images included (F, N, ntypes); each frame's number of half-list pairs (F,)
    (an atom's own images: each ±n once); and each frame's shortest distance (F,) (inf: no
    pair)."""
    coords = np.ascontiguousarray(coords, dtype=np.float64)
    boxes = np.ascontiguousarray(boxes, dtype=np.float64)
    nframes, natoms = coords.shape[:2]
    counts = np.zeros((nframes, natoms, ntypes), dtype=np.int64)
    pairs = np.zeros(nframes, dtype=np.int64)
    lowest = np.full(nframes, np.inf)
    full, own = _pair_grid(natoms), diagonal(natoms)
    for chosen, size in pass_groups(coords, boxes, rcut, _CANDIDATES_PER_PASS)[0]:
        times, lowest[chosen] = _count_pass(coords[chosen], boxes[chosen], size, rcut)
        pairs[chosen] = times.sum(axis=1)
        # atom i sees the images of pair (i, j) or (j, i) as neighbours of j's type; those
        # of the pair (i, i) count twice (each image n and its mirror -n)
        times = times.astype(np.float64)
        onehot = (types[chosen, :, None] == np.arange(ntypes)).astype(np.float64)  # (F, N, T)
        by_atom = np.take(times, full, axis=1).reshape(len(chosen), natoms, natoms)
        found = np.matmul(by_atom, onehot)
        found += times[:, own, None] * onehot
        counts[chosen] = found.astype(np.int64)
    return counts, pairs, lowest


def _count_pass(coords, boxes, size: np.ndarray, rcut: float) -> tuple[np.ndarray, np.ndarray]:
    """Of a few frames of one cell size: each pair's number of images within rcut (F, P)
    (pairs as `images.upper_pairs` orders them) and each frame's shortest distance (F,)."""
    nframes, natoms = coords.shape[:2]
    npairs = len(upper_pairs(natoms)[0])
    found = candidates(coords, boxes, size, rcut)
    base, step = found.base, found.step
    nimages = step.shape[1]
    # |base + step|² = b² + 2 b·s + s² laid out (K, F, P), s = offset @ box: the cross terms
    # of every frame as one product (K, 3) × (3, F·P) of the offsets and base · cell vectors
    along = np.matmul(base, boxes.transpose(0, 2, 1)).reshape(-1, 3)  # (F·P, 3)
    r2 = np.matmul(2.0 * found.offsets, along.T).reshape(nimages, nframes, npairs)
    r2 += _squares(base.transpose(0, 2, 1))
    r2 += _squares(step.transpose(0, 2, 1)).T[:, :, None]
    # an atom's pairs with its own images that the half list leaves out: far away
    r2[:, :, diagonal(natoms)] += np.where(found.own, 0.0, _FAR).T[:, :, None]
    low, high = length_bounds(rcut)
    count_type = np.uint8 if nimages < 256 else np.int64
    times = np.add.reduce(r2 < low, axis=0, dtype=count_type).astype(np.int64).ravel()
    maybe = np.add.reduce(r2 < high, axis=0, dtype=count_type).ravel()
    edge = np.flatnonzero(maybe != times)  # pairs with an image within the margin of rcut
    if len(edge):
        f, p = np.divmod(edge, npairs)
        rows = r2[:, f, p].T  # (edge pairs, K)
        e, k = np.nonzero((rows >= low) & (rows < high))
        inside = _lengths(base, step, f[e], p[e], k) < rcut
        np.add.at(times, edge[e[inside]], 1)
    # each frame's shortest distance: the candidates within the margin of its shortest
    pair_low = r2.min(axis=0)  # (F, P)
    frame_low = pair_low.min(axis=1)
    bound = frame_low + 2.0 * (high - rcut * rcut)
    bound = np.where(bound < low, bound, high)
    close = np.flatnonzero(pair_low <= bound[:, None])
    f, p = np.divmod(close, npairs)
    rows = r2[:, f, p].T
    c, k = np.nonzero((rows <= bound[f][:, None]) & (rows < high))
    dist = _lengths(base, step, f[c], p[c], k)
    inside = dist < rcut
    lowest = np.full(nframes, np.inf)
    np.minimum.at(lowest, f[c][inside], dist[inside])
    return times.reshape(nframes, npairs), lowest


def _pair_grid(natoms: int) -> np.ndarray:
    """(N * N,): the position among `images.upper_pairs` of the pair (min(i, j), max(i, j))
    of each (i, j)."""
    pair_i, pair_j = upper_pairs(natoms)
    grid = np.zeros((natoms, natoms), dtype=np.int64)
    grid[pair_i, pair_j] = grid[pair_j, pair_i] = np.arange(len(pair_i))
    return grid.ravel()


def _squares(vectors: np.ndarray) -> np.ndarray:
    """Squared lengths of (F, 3, n) vectors (a sum over a short last axis costs more)."""
    return (
        vectors[:, 0] * vectors[:, 0]
        + vectors[:, 1] * vectors[:, 1]
        + vectors[:, 2] * vectors[:, 2]
    )


def _lengths(base, step, f, p, k) -> np.ndarray:
    """Distances of candidates (frame ``f``, pair ``p``, image ``k``), computed as
    `images.image_pairs` computes them (the same vectors, the same sums)."""
    vec = np.take(base.reshape(-1, 3), f * base.shape[1] + p, axis=0)
    vec += np.take(step.reshape(-1, 3), f * step.shape[1] + k, axis=0)
    return np.sqrt(np.einsum("pa,pa->p", vec, vec))
