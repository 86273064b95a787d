"""Neighbour pairs of small periodic cells by image replication, many frames in one pass.

Why: data sets of bulk unit cells and small supercells hold thousands of systems of a few
atoms in cells shorter than twice the cut-off. The compiled library takes about 100–250 µs
per such frame, and each call from Python adds its own overhead; the arithmetic of trying
every image of every pair costs about as much per frame. Here the frames of many systems
(same atom count and cell size) are searched together in a few numpy passes, so that
per-frame and per-call costs disappear (``NeighborSearch.many`` chooses this search by cell
size; ``docs/performance.md`` has the figures).

How: positions are wrapped into the cell (fractional ``w = frac - floor(frac)``). For the
pair (i, j) the fractional difference ``d = w_j - w_i`` lies in (-1, 1), and an image ``n``
can be within ``rcut`` only if ``|d_a + n_a| < rcut / h_a`` on every axis ``a`` (``h_a``
the spacing of the lattice planes across axis ``a``): at most ``floor(2 rcut / h_a) + 1``
consecutive integers from ``ceil(-rcut / h_a - d_a)``. Every candidate of that small box of
images is tried, for every pair i <= j at once. The pairs are given in the original
coordinates: shift ``n + k_i - k_j`` (``k = floor(frac)``), vector ``coord[j] - coord[i] +
shift @ box`` (as the model forms it, up to rounding), distance strictly below rcut.

The half list holds each pair once: (i, j, n) for i < j, and an atom's own image (i, i, n)
for ``n`` lexicographically positive (its mirror ``-n`` is the same pair).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

_MARGIN = 1e-9  # on the image ranges (fractional) and, relative, on the distance pre-filter
# (`length_bounds`)
_CANDIDATES_PER_PASS = 1 << 17  # (frame, pair, image) candidates evaluated together
MAX_CANDIDATES = 1 << 14  # per frame; larger frames go to the library (see `small_cells`)
MIN_HEIGHT = 1e-3  # Å: flatter cells are left to the library (which reports them)


def plane_heights(boxes: np.ndarray) -> np.ndarray:
    """(F, 3) spacing of the lattice planes across each cell vector, volume / area of the
    face of the two others (0 for a cell without volume)."""
    a, b, c = boxes[:, 0], boxes[:, 1], boxes[:, 2]
    areas = np.stack([_cross(b, c), _cross(c, a), _cross(a, b)], axis=1)  # (F, 3, 3)
    volume = np.abs(np.einsum("fa,fa->f", a, areas[:, 0]))
    with np.errstate(divide="ignore", invalid="ignore"):
        heights = volume[:, None] / np.linalg.norm(areas, axis=2)
    return np.where(np.isfinite(heights), heights, 0.0)


def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cross products (n, 3): ``np.cross``'s arithmetic without its axis handling,
    which cost more than the search itself for a few frames."""
    return np.stack(
        [
            a[:, 1] * b[:, 2] - a[:, 2] * b[:, 1],
            a[:, 2] * b[:, 0] - a[:, 0] * b[:, 2],
            a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0],
        ],
        axis=-1,
    )


def image_counts(heights: np.ndarray, rcut: float) -> np.ndarray:
    """(F, 3) images per axis that a pair may need (see the module's docstring)."""
    return np.floor(2.0 * (rcut / heights + _MARGIN)).astype(np.int64) + 1


def length_bounds(rcut: float) -> tuple[float, float]:
    """Squared lengths, as ``b² + 2 b·s + s²`` gives them, below which a candidate surely lies
    within ``rcut`` and at or above which it surely does not: rounding moves them by far
    less than these margins (``_MARGIN`` relative, and absolute)."""
    return rcut * rcut * (1.0 - _MARGIN) - _MARGIN, rcut * rcut * (1.0 + _MARGIN) + _MARGIN


def finite_frame(coord: np.ndarray, box: np.ndarray | None) -> bool:
    """Whether a frame's coordinates (and cell) are all finite numbers."""
    return bool(np.isfinite(coord).all() and (box is None or np.isfinite(box).all()))


def small_cells(
    batches: list[tuple[np.ndarray, np.ndarray]], rcut: float
) -> tuple[np.ndarray, np.ndarray]:
    """Of the frames of ``batches`` ``(coords (F, N, 3), boxes (F, 3, 3))``, taken in order:
    which ones (ΣF,) this search takes, which ones can be searched at all (finite, in cells
    of volume: planes at least ``MIN_HEIGHT`` apart), and their images per axis (ΣF, 3).
    It takes the cells shorter than ``2 rcut`` across some axis whose candidates (atoms² ×
    images) stay under ``MAX_CANDIDATES`` (beyond, the library's cell list is faster)."""
    boxes = np.concatenate([b for _, b in batches]).reshape(-1, 9)
    natoms = np.repeat([c.shape[1] for c, _ in batches], [len(c) for c, _ in batches])
    finite = np.isfinite(boxes).all(axis=1)
    if len(natoms) and natoms.all():  # each frame's coordinates at once: one pass over all of them
        values = np.concatenate([c.reshape(-1) for c, _ in batches])
        starts = np.concatenate(([0], np.cumsum(3 * natoms)[:-1]))
        finite &= np.logical_and.reduceat(np.isfinite(values), starts)
    else:
        finite &= np.concatenate(
            [np.isfinite(c.reshape(len(c), -1)).all(axis=1) for c, _ in batches]
        )
    heights = plane_heights(np.where(finite[:, None], boxes, np.eye(3).ravel()).reshape(-1, 3, 3))
    lowest = heights.min(axis=1)
    ok = finite & (lowest >= MIN_HEIGHT)
    counts = image_counts(np.where(ok[:, None], heights, 1.0), rcut)
    small = ok & (lowest < 2.0 * rcut) & (natoms * natoms * counts.prod(axis=1) <= MAX_CANDIDATES)
    return small, ok, counts


def pass_groups(coords: np.ndarray, boxes: np.ndarray, rcut: float, per_pass: int):
    """The frames to search together: ``(rows, images per axis)`` for the frames of one cell
    size, at most about ``per_pass`` candidates (frame, pair, image) at a time, and whether
    there are several cell sizes (then the frames come out of order)."""
    nframes, natoms = coords.shape[:2]
    counts = image_counts(plane_heights(boxes), rcut)
    if (counts == counts[:1]).all():  # cells of one size (usual): no grouping to do
        kinds, kind = counts[:1], np.zeros(nframes, dtype=np.int64)
    else:  # frames of one cell size together
        kinds, kind = np.unique(counts, axis=0, return_inverse=True)
    found = []
    for index, size in enumerate(kinds):
        rows = np.flatnonzero(kind.ravel() == index) if len(kinds) > 1 else np.arange(nframes)
        step = max(1, per_pass // (natoms * natoms * int(np.prod(size))))
        found.extend((rows[a : a + step], size) for a in range(0, len(rows), step))
    return found, len(kinds) > 1


def image_pairs(
    coords: np.ndarray,
    boxes: np.ndarray,
    rcut: float,
    full: bool = False,
    shifts: bool = True,
    vectors: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """Pairs within ``rcut`` of frames ``coords`` (F, N, 3) in cells ``boxes`` (F, 3, 3),
    every image included: ``(frame, i, j, shift, dist, vec)`` ordered by frame, ``shift``
    and ``vec`` (the vectors from ``i`` to ``j``'s image) None unless asked. ``full``: both
    directions of every pair, else the half list. The cells must have volume.
    """
    coords = np.ascontiguousarray(coords, dtype=np.float64)
    boxes = np.ascontiguousarray(boxes, dtype=np.float64)
    groups, mixed = pass_groups(coords, boxes, rcut, _CANDIDATES_PER_PASS)
    parts = []
    for chosen, size in groups:
        part = _pass(coords[chosen], boxes[chosen], size, rcut, shifts or full, vectors)
        part[0] = chosen[part[0]]
        parts.append(part)
    if len(parts) == 1:
        frame, i, j, shift, dist, vec = parts[0]
    elif parts:
        frame, i, j, dist = (np.concatenate([p[n] for p in parts]) for n in (0, 1, 2, 4))
        shift = np.concatenate([p[3] for p in parts]) if parts[0][3] is not None else None
        vec = np.concatenate([p[5] for p in parts]) if vectors else None
        if mixed:
            order = np.argsort(frame, kind="stable")
            frame, i, j, dist = (a[order] for a in (frame, i, j, dist))
            shift = None if shift is None else shift[order]
            vec = None if vec is None else vec[order]
    else:
        frame = i = j = np.zeros(0, dtype=np.int64)
        shift, dist, vec = np.zeros((0, 3), dtype=np.int64), np.zeros(0), np.zeros((0, 3))
    if full:  # the mirror of each pair, frame by frame
        order = np.argsort(np.concatenate((frame, frame)), kind="stable")
        frame = np.concatenate((frame, frame))[order]
        i, j = np.concatenate((i, j))[order], np.concatenate((j, i))[order]
        shift = np.concatenate((shift, -shift))[order] if shifts else None
        dist = np.concatenate((dist, dist))[order]
        vec = np.concatenate((vec, -vec))[order] if vectors else None
    return frame, i, j, (shift if shifts else None), dist, (vec if vectors else None)


class Candidates(NamedTuple):
    """Every image of every pair i <= j that may lie within rcut, for a few frames of one
    cell size: pair ``p`` (``upper_pairs``) of frame ``f`` takes ``j``'s images
    ``first[f, p] + offsets[k]``, whose vectors from ``i`` are ``base[f, p] + step[f, k]``."""

    base: np.ndarray  # (F, P, 3): coord_j - coord_i + first @ box
    first: np.ndarray  # (F, P, 3) float: each pair's first image, in the original coordinates
    step: np.ndarray  # (F, K, 3): offsets @ box
    offsets: np.ndarray  # (K, 3) int
    own: np.ndarray  # (F, K) bool: the images an atom's pair with itself takes (n > 0)


def candidates(coords: np.ndarray, boxes: np.ndarray, size: np.ndarray, rcut: float) -> Candidates:
    """The candidates of frames ``coords`` (F, N, 3) in cells ``boxes`` of ``size`` images
    per axis (see the module's docstring)."""
    pair_i, pair_j = upper_pairs(coords.shape[1])
    inverse = np.linalg.inv(boxes)
    frac = coords @ inverse  # (F, N, 3)
    fold = np.floor(frac)
    w = frac - fold
    d = np.take(w, pair_j, axis=1) - np.take(w, pair_i, axis=1)  # (F, P, 3): in (-1, 1)
    reach = rcut * np.linalg.norm(inverse, axis=1) + _MARGIN  # (F, 3): rcut / h
    first = np.ceil(-reach[:, None, :] - d)  # (F, P, 3): each pair's first image per axis
    # that image's shift in the original coordinates, and its vector
    first += np.take(fold, pair_i, axis=1) - np.take(fold, pair_j, axis=1)
    base = np.take(coords, pair_j, axis=1) - np.take(coords, pair_i, axis=1)
    base += first @ boxes  # (F, P, 3): coord_j - coord_i + first @ box
    offsets = np.array(list(itertools.product(*(range(int(k)) for k in size))))
    step = offsets.astype(np.float64) @ boxes  # (F, K, 3)
    # an atom's own images (i = j, d = 0): each ±n pair once (n lexicographically
    # positive), never the atom itself (n = 0)
    own = offsets[None] + np.ceil(-reach)[:, None, :].astype(np.int64)  # (F, K, 3): n
    lead = np.where(own[..., 0] != 0, own[..., 0],
                    np.where(own[..., 1] != 0, own[..., 1], own[..., 2]))  # fmt: skip
    return Candidates(base, first, step, offsets, lead > 0)


def _pass(coords, boxes, size: np.ndarray, rcut: float, shifts: bool, vectors: bool) -> list:
    """Half-list pairs of a few frames: every candidate (frame, pair i <= j, image) at once
    (``vectors`` False: the vectors are not kept, which the statistics do not need)."""
    natoms = coords.shape[1]
    pair_i, pair_j = upper_pairs(natoms)
    npairs = len(pair_i)
    base, first, step, offsets, own = candidates(coords, boxes, size, rcut)
    nimages = len(offsets)
    r2 = np.matmul(base, step.transpose(0, 2, 1))  # |base + step|² = b² + 2 b·s + s²
    r2 *= 2.0
    r2 += np.einsum("fpa,fpa->fp", base, base)[:, :, None]
    r2 += np.einsum("fka,fka->fk", step, step)[:, None, :]
    near = r2 < length_bounds(rcut)[1]
    near[:, diagonal(natoms)] &= own[:, None, :]
    flat = np.flatnonzero(near)
    fp = flat // nimages
    k = flat - fp * nimages
    f = fp // npairs
    p = fp - f * npairs
    i, j = np.take(pair_i, p), np.take(pair_j, p)
    vec = np.take(base.reshape(-1, 3), fp, axis=0)
    vec += np.take(step.reshape(-1, 3), f * nimages + k, axis=0)
    dist = np.sqrt(np.einsum("pa,pa->p", vec, vec))
    shift = None
    if shifts:
        shift = np.take(first.reshape(-1, 3), fp, axis=0).astype(np.int64)
        shift += np.take(offsets, k, axis=0)
    inside = dist < rcut
    vec = vec if vectors else None
    if not inside.all():
        f, i, j, dist = f[inside], i[inside], j[inside], dist[inside]
        shift = None if shift is None else shift[inside]
        vec = None if vec is None else vec[inside]
    return [f, i, j, shift, dist, vec]


_UPPER: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def upper_pairs(natoms: int) -> tuple[np.ndarray, np.ndarray]:
    """The pairs i <= j of ``natoms`` atoms: (P,) i and (P,) j."""
    pairs = _UPPER.get(natoms)
    if pairs is None:
        pairs = _UPPER.setdefault(natoms, tuple(np.triu_indices(natoms)))
    return pairs


def diagonal(natoms: int) -> np.ndarray:
    """The positions of the pairs (i, i) among `upper_pairs`'."""
    pair_i, pair_j = upper_pairs(natoms)
    return np.flatnonzero(pair_i == pair_j)
