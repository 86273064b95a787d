"""Type-mixed neighbour lists: one list of ``sel`` slots over all types, nearest first.

The descriptors with a type embedding (se_atten, se_atten_v2, se_e3_tebd) read neighbour
types from ``atype[nlist]`` instead of from the slot's block, so their list is not split
per type: the ``sel`` nearest neighbours of each atom within ``rcut`` (periodic images
included), -1 padding, as DeePMD-kit's ``mixed_types`` lists. Ties in distance are broken
by neighbour index and image shift, so the layout does not depend on the pair search.
"""

from __future__ import annotations

import numpy as np

from mdtrain.neighbors.nlist import Pairs, neighbor_pairs, pair_order


def mixed_nlist_from_pairs(
    pairs: Pairs, natoms: int, sel: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(nlist, shift, counts)`` from a frame's full pair list; see `build_mixed_nlist`."""
    order = pair_order(pairs, pairs.i)
    ci, cj, cs = pairs.i[order], pairs.j[order], pairs.shift[order]
    counts = np.bincount(ci, minlength=natoms)
    start = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.arange(len(ci)) - start[ci]
    keep = rank < sel
    nlist = np.full((natoms, sel), -1, dtype=np.int64)
    shift = np.zeros((natoms, sel, 3), dtype=np.int64)
    nlist[ci[keep], rank[keep]] = cj[keep]
    shift[ci[keep], rank[keep]] = cs[keep]
    return nlist, shift, counts


def build_mixed_nlist(
    coord: np.ndarray, box: np.ndarray | None, rcut: float, sel: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Type-mixed padded neighbour list of one frame.

    Returns ``nlist`` (natoms, sel) int64 with -1 in padded slots, ``shift`` (natoms, sel,
    3) int64 image shifts (0 in padded slots; the neighbour sits at ``coord[j] + shift @
    box``) and ``counts`` (natoms,), the neighbours found within rcut before truncation to
    ``sel``. ``box`` holds the cell vectors as rows, or is None for a non-periodic frame.
    """
    coord = np.asarray(coord, dtype=np.float64)
    pairs = neighbor_pairs(coord, box, rcut)
    return mixed_nlist_from_pairs(pairs, len(coord), int(sel))
