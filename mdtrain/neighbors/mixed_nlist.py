"""Type-mixed neighbour lists: one list of ``sel`` slots over all types, nearest first.

The descriptors with a type embedding (se_atten, se_atten_v2, se_e3_tebd) read neighbour
types from ``atype[nlist]`` instead of from the slot's block, so their list is not split
per type: the ``sel`` nearest neighbours of each atom within ``rcut`` (periodic images
included), -1 padding, as DeePMD-kit's ``mixed_types`` lists. Ties in distance are broken
by neighbour index and image shift, so the layout does not depend on the pair search.
"""

from __future__ import annotations

import numpy as np

from mdtrain.neighbors.nlist import Pairs, frame_pairs
from mdtrain.neighbors.slots import padded_lists, pair_order


def mixed_nlist_from_pairs(
    pairs: Pairs, natoms: int, sel: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(nlist, shift, counts)`` from a frame's full pair list; see `build_mixed_nlist`."""
    nlist, shift, counts = padded_lists(pairs, pairs.i, pair_order(pairs, pairs.i), natoms, [sel])
    return nlist, shift, counts[:, 0]


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
    pairs = frame_pairs(coord, box, rcut)
    return mixed_nlist_from_pairs(pairs, len(coord), int(sel))
