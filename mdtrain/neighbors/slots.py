"""A frame's pairs put in order and into the padded slots of its neighbour lists: the part of
`build_nlist` and `build_mixed_nlist` after the search.

The order (by centre and block, then distance; ties by neighbour index and image shift) is
found with one sort of packed integer keys where it can be (`_keyed_order`), and the slots
are filled by one gather from the pairs, so that a training's first epoch, which builds a
list for every frame it draws, spends little beyond the search itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mdtrain.neighbors.nlist import Pairs

_MIN_DIST_BITS = 20  # fewer bits for the distance: the plain sorts decide
_MAX_DIST_BITS = 50  # quantised distances stay exact integers in float64, rounding included


def pair_order(pairs: Pairs, group: np.ndarray) -> np.ndarray:
    """The order of ``pairs`` by ``group`` (a non-negative integer per pair: the centre, or
    the centre and the neighbour's type), then distance, ties broken by neighbour index and
    image shift, so that a list's layout does not depend on the library's internal order.

    The same order as one ``np.lexsort`` of all those keys, found faster: one sort of packed
    keys (`_keyed_order`) when that decides every pair; else by distance, then a stable sort
    by group (a radix sort when the groups fit 16 bits); only where two pairs of one group
    lie at exactly the same distance (a perfect lattice) is the full sort run.
    """
    if len(group) == 0:
        return np.zeros(0, dtype=np.int64)
    keyed = _keyed_order(group, pairs.dist)
    if keyed is not None:
        return keyed
    small = group.astype(np.int16) if int(group.max()) < 2**15 else group
    by_dist = np.argsort(pairs.dist)
    order = by_dist[np.argsort(small[by_dist], kind="stable")]
    g, d = group[order], pairs.dist[order]
    if np.any((g[1:] == g[:-1]) & (d[1:] == d[:-1])):
        s = pairs.shift
        return np.lexsort((s[:, 2], s[:, 1], s[:, 0], pairs.j, pairs.dist, group))
    return order


def _keyed_order(group: np.ndarray, dist: np.ndarray) -> np.ndarray | None:
    """The order by group then distance from one sort of int64 keys ``group | q | index``,
    ``q`` the distance quantised (rounding down, so ``d1 < d2`` gives ``q1 <= q2``); None
    when that does not decide it: too few bits left for ``q``, or two pairs of one group
    in one quantum (their distances may differ or be equal: the other sorts decide).

    Where every group's quanta differ, distances within a group strictly increase along
    the sorted keys: that is the only order by group and distance, ties never arising."""
    n = len(group)
    group = group.astype(np.int64, copy=False)
    index_bits = max(1, (n - 1).bit_length())
    group_bits = max(1, int(group.max()).bit_length())
    dist_bits = min(_MAX_DIST_BITS, 63 - index_bits - group_bits)
    top = float(dist.max())
    levels = float(2**dist_bits - 1)
    scale = levels / top if np.isfinite(top) and top > 0.0 else np.inf
    if dist_bits < _MIN_DIST_BITS or not np.isfinite(scale):
        return None
    q = np.minimum(dist * scale, levels).astype(np.int64)  # >= 0: floor
    keys = (group << (dist_bits + index_bits)) | (q << index_bits)
    keys |= np.arange(n, dtype=np.int64)
    keys.sort()
    high = keys >> index_bits  # group and quantum
    if np.any(high[1:] == high[:-1]):
        return None
    return keys & ((1 << index_bits) - 1)


def padded_lists(
    pairs: Pairs, group: np.ndarray, order: np.ndarray, natoms: int, sel: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(nlist, shift, counts)`` of pairs in ``order``, ``group`` being ``i * len(sel) +
    block``: block ``b`` of atom ``i``'s list takes its first ``sel[b]`` pairs, nearest
    first; -1 and zero shifts pad. ``counts`` (natoms, len(sel)): pairs per block before
    truncation.

    Each slot is filled by one gather: the pair that lands there (an extra row of -1 and
    zeros for padding), rather than gathering the sorted pairs and scattering them."""
    nblocks, nnei, npairs = len(sel), int(sum(sel)), len(group)
    g = group[order]
    counts = np.bincount(g, minlength=natoms * nblocks)
    start = np.zeros(natoms * nblocks, dtype=np.int64)
    np.cumsum(counts[:-1], out=start[1:])
    rank = np.arange(npairs, dtype=np.int64) - start[g]
    centre, block = np.divmod(g, nblocks)
    offsets = np.concatenate(([0], np.cumsum(sel)[:-1])).astype(np.int64)
    keep = rank < np.asarray(sel, dtype=np.int64)[block]
    slot = centre * nnei + offsets[block] + rank
    source = np.full(natoms * nnei, npairs, dtype=np.int64)  # npairs: the padding row
    source[slot[keep]] = order[keep]
    nlist = np.append(pairs.j, -1)[source].reshape(natoms, nnei)
    rows = np.zeros((npairs + 1, 3), dtype=np.int64)
    rows[:npairs] = pairs.shift
    row = np.dtype((np.void, rows.itemsize * 3))  # whole rows: one gather, not three
    shift = rows.view(row).reshape(-1)[source].view(np.int64).reshape(natoms, nnei, 3)
    return nlist, shift, counts.reshape(natoms, nblocks)
