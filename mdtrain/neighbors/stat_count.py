"""Counting the searched pairs of the neighbour statistics (`mdtrain.neighbors.stat`): each
chunk's smallest distance, largest neighbour counts and frames with a lonely atom.

Two paths, the same numbers: `count_window` counts every frame of a window of many systems
in a few array operations (thousands of small systems otherwise cost a few numpy calls per
frame each); `count_chunk` goes frame by frame through one chunk and reports the first frame
with a problem (not searched, the search's error, overlapping atoms) in order. A window that
holds any such frame, or a frame without a pair (which needs a wider search for its
smallest distance), is counted by `count_chunk`, chunk after chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mdtrain.errors import MDTrainError
from mdtrain.neighbors.images import plane_heights
from mdtrain.neighbors.nlist import NeighborSearch
from mdtrain.neighbors.window import WindowPairs

OVERLAP_DISTANCE = 1e-3  # Å; closer atoms are reported as overlapping
PAIRS_PER_SETTLE = 1 << 16  # `count_chunk` counts frames together up to about this many pairs


@dataclass
class ChunkStat:
    """The statistics of a few consecutive frames of one system."""

    min_dist: float = math.inf
    max_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    lonely: list[int] = field(default_factory=list)  # frames where some atom has no neighbour
    max_total: int = 0  # neighbours of all types together


@dataclass
class WindowStat:
    """The statistics of the chunks of a window, as arrays over its chunks."""

    min_dist: np.ndarray  # (chunks,) float64
    max_counts: np.ndarray  # (chunks, ntypes) int64
    max_total: np.ndarray  # (chunks,) int64
    lonely: dict[int, list[int]]  # chunk -> frames where some atom has no neighbour

    @classmethod
    def of_chunks(cls, chunks: list[ChunkStat], ntypes: int) -> WindowStat:
        return cls(
            np.array([c.min_dist for c in chunks], dtype=np.float64),
            np.array([c.max_counts for c in chunks], dtype=np.int64).reshape(-1, ntypes),
            np.array([c.max_total for c in chunks], dtype=np.int64),
            {b: c.lonely for b, c in enumerate(chunks) if c.lonely},
        )


def count_window(
    atypes: list[np.ndarray], rows: list[np.ndarray], pairs: WindowPairs, ntypes: int
) -> WindowStat | None:
    """The statistics of each chunk of a window (its atom types ``atypes[b]`` and frame
    numbers ``rows[b]``) from its pairs, all frames at once; None when some frame needs
    `count_chunk` (see the module's docstring)."""
    if pairs.failed or not pairs.sizes.all():
        return None
    lengths = np.diff(pairs.starts)
    sizes = np.array([len(a) for a in atypes], dtype=np.int64)
    natoms = np.repeat(sizes, lengths)
    atom_start = np.concatenate(([0], np.cumsum(natoms)))  # of each frame, then the end
    total = int(atom_start[-1])
    # each frame's atoms take their chunk's types: one gather, not a tile per chunk
    first_type = np.repeat(np.cumsum(sizes) - sizes, lengths)  # of each frame's chunk
    shift = np.repeat(first_type - atom_start[:-1], natoms)
    atype = np.concatenate(atypes)[np.arange(total) + shift]
    counts = np.zeros(total * ntypes, dtype=np.int64)
    lowest = np.empty(len(natoms))
    for part in pairs.parts:
        if not len(part.i):
            continue
        base = atom_start[part.frame]
        i, j = base + part.i, base + part.j
        # each half-list pair (i, j) is a neighbour of both ends; a self-image pair counts twice
        keys = np.concatenate((i * ntypes + atype[j], j * ntypes + atype[i]))
        counts += np.bincount(keys, minlength=total * ntypes)
        first = np.flatnonzero(np.diff(part.frame, prepend=-1))  # each frame's first pair
        lowest[part.frame[first]] = np.minimum.reduceat(part.dist, first)
    for counted in pairs.counted:  # each atom's neighbours, counted per type
        atoms = atom_start[counted.frames, None] + np.arange(counted.counts.shape[1])
        counts.reshape(total, ntypes)[atoms.ravel()] += counted.counts.reshape(-1, ntypes)
        lowest[counted.frames] = counted.lowest
    if (lowest < OVERLAP_DISTANCE).any():
        return None
    counts = counts.reshape(total, ntypes)
    per_atom = counts.sum(axis=1)
    lonely = np.logical_or.reduceat(per_atom == 0, atom_start[:-1])  # per frame
    chunk_atoms = atom_start[pairs.starts[:-1]]
    max_counts = np.maximum.reduceat(counts, chunk_atoms, axis=0)
    max_total = np.maximum.reduceat(per_atom, chunk_atoms)
    min_dist = np.minimum.reduceat(lowest, pairs.starts[:-1])
    alone: dict[int, list[int]] = {}
    for g in np.flatnonzero(lonely).tolist():  # window frame g: chunk b's frame g - starts[b]
        b = int(np.searchsorted(pairs.starts, g, side="right")) - 1
        alone.setdefault(b, []).append(int(rows[b][g - pairs.starts[b]]))
    return WindowStat(min_dist, max_counts, max_total, alone)


def min_distance_beyond(rcut: float, coord: np.ndarray, box: np.ndarray | None) -> float:
    """Smallest distance in a frame that has no pair within rcut: search wider until found."""
    if box is not None:
        bound = float(np.linalg.norm(box, axis=1).min())  # an atom's own image is this close
    else:
        bound = float(np.linalg.norm(coord.max(axis=0) - coord.min(axis=0)))
    cutoff = 2.0 * rcut
    while True:
        _, _, _, dist = NeighborSearch(cutoff).compute(coord, box, full=False, shifts=False)
        if len(dist):
            return float(dist.min())
        if cutoff > bound:
            return math.inf
        cutoff *= 2.0


def count_chunk(
    rcut: float,
    path: str,
    atype: np.ndarray,
    ntypes: int,
    rows: np.ndarray,
    coords: np.ndarray,
    boxes: np.ndarray | None,
    visit: Callable | None,
    searched: list,
) -> ChunkStat:
    """Count and check the pairs ``searched`` (`WindowPairs.per_frame`'s entries for these
    frames) frame by frame, counting many frames at once (`_settle`). Problems are reported
    for the first frame that has one. ``visit(frame, i, j, vec)`` sees each frame's
    half-list pairs and their vectors (copies: the visitor may keep them)."""
    natoms = len(atype)
    chunk = ChunkStat(math.inf, np.zeros(ntypes, dtype=np.int64), [])
    if all(r is not None for r in searched):
        spacing, finite = None, np.ones(len(rows), dtype=bool)  # the search checked them
    else:
        spacing = None if boxes is None else plane_heights(boxes).min(axis=1)
        finite = np.isfinite(coords.reshape(len(rows), -1)).all(axis=1)  # whole chunk at once
        if boxes is not None:
            finite &= np.isfinite(boxes.reshape(len(rows), -1)).all(axis=1)
    found: list[tuple] = []  # (frame, i, j, dist, vec) of frames not yet settled
    npairs = 0

    def settle() -> None:
        nonlocal found, npairs
        if found:
            _settle(found, path, atype, ntypes, chunk, visit)
        found, npairs = [], 0

    def fail(message: str) -> MDTrainError:
        settle()  # an earlier frame's problem is reported first
        return MDTrainError(message)

    for k, index in enumerate(rows.tolist()):
        coord = coords[k]
        box = None if boxes is None else boxes[k]
        if not finite[k]:
            raise fail(f"system {path}, frame {index}: coordinates or cell not finite")
        if spacing is not None and not spacing[k] >= OVERLAP_DISTANCE:
            raise fail(
                f"system {path}, frame {index}: the cell is degenerate (its vectors span no "
                f"volume; thinnest layer {spacing[k]:.2e} Å): each atom overlaps its own images"
            )
        if isinstance(searched[k], ValueError):
            raise fail(f"system {path}, frame {index}: {searched[k]}")
        i, j, dist, vec = searched[k]
        if len(dist) == 0:
            chunk.lonely.append(index)
            if natoms > 1 or box is not None:
                chunk.min_dist = min(chunk.min_dist, min_distance_beyond(rcut, coord, box))
            if visit is not None:
                visit(index, i, j, vec)
            continue
        found.append((index, i, j, dist, vec))
        npairs += len(dist)
        if npairs >= PAIRS_PER_SETTLE:
            settle()
    settle()
    return chunk


def _settle(found: list[tuple], path: str, atype, ntypes: int, chunk: ChunkStat, visit) -> None:
    """Minimum distance, overlaps, neighbour counts and lonely atoms of frames searched by
    `count_chunk` (each with at least one pair), all frames at once; then their visits."""
    natoms = len(atype)
    sizes = np.array([len(f[3]) for f in found])
    i, j, dist = (np.concatenate([f[n] for f in found]) for n in (1, 2, 3))
    starts = np.cumsum(sizes) - sizes
    lowest = np.minimum.reduceat(dist, starts)
    overlapping = np.flatnonzero(lowest < OVERLAP_DISTANCE)
    if len(overlapping):
        f = int(overlapping[0])
        closest = int(starts[f] + np.argmin(dist[starts[f] : starts[f] + sizes[f]]))
        raise MDTrainError(
            f"system {path}, frame {found[f][0]}: atoms {int(i[closest])} and "
            f"{int(j[closest])} overlap (distance {dist[closest]:.2e} Å, periodic images "
            "included)"
        )
    chunk.min_dist = min(chunk.min_dist, float(lowest.min()))
    # Each half-list pair (i, j) is a neighbour of both ends; a self-image pair counts twice.
    base = np.repeat(np.arange(len(found)) * natoms, sizes)
    keys = np.concatenate(((base + i) * ntypes + atype[j], (base + j) * ntypes + atype[i]))
    counts = np.bincount(keys, minlength=len(found) * natoms * ntypes)
    counts = counts.reshape(len(found), natoms, ntypes)
    np.maximum(chunk.max_counts, counts.max(axis=(0, 1)), out=chunk.max_counts)
    chunk.max_total = max(chunk.max_total, int(counts.sum(axis=2).max()))
    lonely = ~counts.any(axis=2).all(axis=1)
    chunk.lonely.extend(found[f][0] for f in np.flatnonzero(lonely).tolist())
    if visit is not None:
        for index, fi, fj, _, vec in found:
            visit(index, fi, fj, vec)
