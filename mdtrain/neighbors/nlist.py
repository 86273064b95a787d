"""Neighbour lists: one code path for neighbor-stat, statistics, training and inference.

Pairs come from the compiled ``vesin`` cell list. Indices and integer image shifts are
computed here, outside autograd; the model rebuilds distance vectors from them as
``coord[j] - coord[i] + shift @ box`` so that forces and virials flow through the positions
and the cell only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import vesin

_ZERO_BOX = np.zeros((3, 3))


@dataclass(frozen=True)
class Pairs:
    """All ordered pairs (i, j, shift) with |r_j - r_i + shift @ box| < rcut, self excluded."""

    i: np.ndarray  # (npairs,) int64, centre atom
    j: np.ndarray  # (npairs,) int64, neighbour atom
    shift: np.ndarray  # (npairs, 3) int64, image of j in units of the cell vectors
    dist: np.ndarray  # (npairs,) float64


def neighbor_pairs(coord: np.ndarray, box: np.ndarray | None, rcut: float) -> Pairs:
    """Full (both directions) neighbour pairs of one frame.

    ``box`` holds the cell vectors as rows, or is ``None`` for a non-periodic frame. Cells
    shorter than 2·rcut are handled: one atom may see several images of the same neighbour
    and its own images.
    """
    coord = np.ascontiguousarray(coord, dtype=np.float64)
    periodic = box is not None
    cell = _ZERO_BOX if box is None else np.ascontiguousarray(box, dtype=np.float64)
    calculator = vesin.NeighborList(cutoff=float(rcut), full_list=True)
    i, j, shift, dist = calculator.compute(coord, cell, periodic, quantities="ijSd", copy=True)
    keep = dist < rcut  # vesin includes pairs at exactly rcut; DeePMD uses a strict bound
    return Pairs(
        i=i[keep].astype(np.int64),
        j=j[keep].astype(np.int64),
        shift=shift[keep].astype(np.int64),
        dist=dist[keep],
    )


def build_nlist(
    coord: np.ndarray,
    box: np.ndarray | None,
    atype: np.ndarray,
    rcut: float,
    sel: list[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-type padded neighbour list of one frame, DeePMD layout.

    Returns ``nlist`` (natoms, sum(sel)) int64 with -1 in padded slots, ``shift`` (natoms,
    sum(sel), 3) int64 image shifts (0 in padded slots), and ``counts`` (natoms, ntypes), the
    number of neighbours of each type found within rcut before truncation to ``sel``. Slots
    are laid out as [type 0 block (sel[0]) | type 1 block | ...], nearest first in a block.
    """
    natoms = len(atype)
    ntypes = len(sel)
    nnei = int(sum(sel))
    pairs = neighbor_pairs(coord, box, rcut)
    jtype = atype[pairs.j]
    # Sort by (centre, neighbour type, distance); ties broken by neighbour index for determinism.
    order = np.lexsort((pairs.j, pairs.dist, jtype, pairs.i))
    ci, cj, ct, cs = pairs.i[order], pairs.j[order], jtype[order], pairs.shift[order]
    group = ci * ntypes + ct
    counts = np.bincount(group, minlength=natoms * ntypes).reshape(natoms, ntypes)
    group_start = np.concatenate(([0], np.cumsum(counts.ravel())[:-1]))
    rank_in_group = np.arange(len(ci)) - group_start[group]
    offsets = np.concatenate(([0], np.cumsum(sel)[:-1]))
    keep = rank_in_group < np.asarray(sel)[ct]
    slot = offsets[ct[keep]] + rank_in_group[keep]
    nlist = np.full((natoms, nnei), -1, dtype=np.int64)
    shift = np.zeros((natoms, nnei, 3), dtype=np.int64)
    nlist[ci[keep], slot] = cj[keep]
    shift[ci[keep], slot] = cs[keep]
    return nlist, shift, counts
