"""Half-list neighbour pairs of many frames at once: the frames of many systems that the
neighbour statistics read together (a window of about 65,000 atoms).

The search is chosen here, by cell size: frames in cells shorter than twice the cut-off
(`images.small_cells`) are searched together, all frames of one atom count and cell size in
one vectorised pass (`images.image_pairs`); the others one by one by the library
(`NeighborSearch`). Both give the same pairs and distances (``tests/neighbors/test_images.py``).
One frame at a time (training batches, inference) is the library's: a pass of numpy
operations over a single small frame costs about what the library does.

The result keeps the pairs as the searches give them, one part per search (a part's pairs
lie frame after frame), so that whoever only counts them needs no reordering; `frame_order`
and `per_frame` put them frame after frame when a visitor needs each frame's pairs. Given
the atoms' types (the neighbour statistics without a visitor), the small cells' neighbours
are counted per atom and type, not listed (`image_count.neighbor_counts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from mdtrain.neighbors import images
from mdtrain.neighbors.image_count import neighbor_counts
from mdtrain.neighbors.nlist import NeighborSearch


@dataclass
class Part:
    """Pairs of one search: ``frame`` (window frame of each pair, non-decreasing), ``i``,
    ``j``, ``dist`` and ``vec`` (None unless asked)."""

    frame: np.ndarray
    i: np.ndarray
    j: np.ndarray
    dist: np.ndarray
    vec: np.ndarray | None


@dataclass
class Counted:
    """Frames of small cells whose neighbours were counted, not listed
    (`image_count.neighbor_counts`): the window ``frames`` (F,), each atom's neighbours of
    each type ``counts`` (F, N, ntypes), and each frame's shortest distance ``lowest``."""

    frames: np.ndarray
    counts: np.ndarray
    lowest: np.ndarray


@dataclass
class WindowPairs:
    """The half-list pairs of the frames of several batches. Frame ``f`` of batch ``b`` is
    window frame ``starts[b] + f``; ``sizes`` counts each frame's pairs; ``failed`` holds the
    frames without pairs to give: None for one not searched (coordinates or cell not finite,
    a cell without volume: the caller reports it), or the library's ValueError. The frames
    of ``counted`` have their pairs counted only (`frame_order` and `per_frame` refuse)."""

    starts: np.ndarray  # (batches + 1,)
    sizes: np.ndarray  # (frames,) int64
    parts: list[Part]
    failed: dict[int, ValueError | None]
    counted: list[Counted] = field(default_factory=list)

    def frame_order(self) -> Part:
        """All pairs as one part, frame after frame (each frame's pairs in search order)."""
        if self.counted:
            raise ValueError("the pairs of counted frames are not listed: search listing them")
        if len(self.parts) == 1:
            return self.parts[0]
        joined = [np.concatenate([getattr(p, name) for p in self.parts]) for name in
                  ("frame", "i", "j", "dist")]  # fmt: skip
        order = np.argsort(joined[0], kind="stable")
        vec = None
        if self.parts[0].vec is not None:
            vec = np.concatenate([p.vec for p in self.parts])[order]
        return Part(*(a[order] for a in joined), vec)

    def per_frame(self) -> list[list[tuple | ValueError | None]]:
        """For each batch, one entry per frame: ``(i, j, dist, vec)`` (arrays the caller may
        keep), or its entry of ``failed``."""
        whole = self.frame_order()
        ends = np.cumsum(self.sizes).tolist()
        out = []
        for b in range(len(self.starts) - 1):
            entries: list = []
            for g in range(int(self.starts[b]), int(self.starts[b + 1])):
                if g in self.failed:
                    entries.append(self.failed[g])
                    continue
                a, z = ends[g] - int(self.sizes[g]), ends[g]
                vec = None if whole.vec is None else whole.vec[a:z]
                entries.append((whole.i[a:z], whole.j[a:z], whole.dist[a:z], vec))
            out.append(entries)
        return out


def search_window(
    search: NeighborSearch,
    batches: list[tuple[np.ndarray, np.ndarray | None]],
    vectors: bool = False,
    types: list[np.ndarray] | None = None,
    ntypes: int = 0,
) -> WindowPairs:
    """Half-list pairs of the frames of ``batches`` ``(coords (F, N, 3), boxes (F, 3, 3) or
    None)``, each searched as the module's docstring says (``search.small_cells`` False:
    every frame by the library; ``types``, each batch's atom types (N,) below ``ntypes``:
    the small cells' neighbours counted, not listed)."""
    lengths = [len(coords) for coords, _ in batches]
    starts = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    nframes = int(starts[-1])
    small = np.zeros(nframes, dtype=bool)
    usable = np.zeros(nframes, dtype=bool)
    checked = np.zeros(nframes, dtype=bool)  # usable is known (periodic frames)
    counts = np.zeros((nframes, 3), dtype=np.int64)
    periodic = [b for b, (_, boxes) in enumerate(batches) if boxes is not None]
    in_cell = np.repeat([boxes is not None for _, boxes in batches], lengths)  # per frame
    if periodic:  # every cell of the batches at once
        rows = np.flatnonzero(in_cell)
        found = images.small_cells([batches[b] for b in periodic], search.rcut)
        small[rows] = found[0] & search.small_cells
        usable[rows], counts[rows], checked[rows] = found[1], found[2], True
    batch_of = np.repeat(np.arange(len(batches)), lengths)
    natoms = np.array([coords.shape[1] for coords, _ in batches], dtype=np.int64)[batch_of]
    parts, failed, counted, sizes_counted = [], {}, [], []
    where = np.flatnonzero(small)
    if len(where):  # frames of one atom count and cell size together
        keys = np.column_stack((natoms[where], counts[where]))
        kinds, kind = np.unique(keys, axis=0, return_inverse=True)
        kind = kind.ravel()
        stacked: dict[int, tuple] = {}
        for k in range(len(kinds)):
            members = where[kind == k]
            size = int(kinds[k][0])
            if size not in stacked:
                stacked[size] = _stacked(batches, in_cell & (natoms == size), size, types)
            all_coords, all_boxes, all_types, row = stacked[size]
            coords, boxes = all_coords[row[members]], all_boxes[row[members]]
            if all_types is not None and not vectors:
                atoms = all_types[row[members]]
                found = neighbor_counts(coords, boxes, atoms, ntypes, search.rcut)
                counted.append(Counted(members, found[0], found[2]))
                sizes_counted.append((members, found[1]))
                continue
            frame, i, j, _, dist, vec = images.image_pairs(
                coords, boxes, search.rcut, shifts=False, vectors=vectors
            )
            parts.append(Part(members[frame], i, j, dist, vec))
    library: list[tuple] = []
    for g in np.flatnonzero(~small).tolist():
        b = int(batch_of[g])
        coords, boxes = batches[b]
        coord, box = coords[g - starts[b]], None if boxes is None else boxes[g - starts[b]]
        if not (usable[g] if checked[g] else images.finite_frame(coord, box)):
            failed[g] = None
            continue
        try:
            i, j, dist, vec = search.half_pairs(coord, box, vectors)
        except ValueError as exc:
            failed[g] = exc
            continue
        library.append((np.full(len(i), g, dtype=np.int64), i, j, dist, vec))
    if library:
        joined = [np.concatenate([found[n] for found in library]) for n in range(4)]
        vec = np.concatenate([found[4] for found in library]) if vectors else None
        parts.append(Part(*joined, vec))
    sizes = np.zeros(nframes, dtype=np.int64)
    for part in parts:
        sizes += np.bincount(part.frame, minlength=nframes)
    for members, npairs in sizes_counted:
        sizes[members] += npairs
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        parts.append(Part(empty, empty, empty, np.zeros(0), np.zeros((0, 3)) if vectors else None))
    return WindowPairs(starts, sizes, parts, failed, counted)


def _stacked(batches: list[tuple], inside: np.ndarray, size: int, types) -> tuple:
    """The window frames ``inside`` (the periodic ones of ``size`` atoms) as one array of
    coordinates, one of cells and (``types`` given: each batch's) one of atom types, and each
    window frame's row in them (-1: not there)."""
    chosen = [b for b, (c, box) in enumerate(batches) if box is not None and c.shape[1] == size]
    row = np.full(len(inside), -1, dtype=np.int64)
    row[inside] = np.arange(int(inside.sum()))
    coords = np.concatenate([batches[b][0] for b in chosen])
    boxes = np.concatenate([batches[b][1] for b in chosen])
    if types is None:
        return coords, boxes, None, row
    lengths = [len(batches[b][0]) for b in chosen]
    return coords, boxes, np.repeat(np.stack([types[b] for b in chosen]), lengths, axis=0), row


def search_chunks(
    chunks: Iterable[tuple],
    single: NeighborSearch,
    multi: NeighborSearch,
    vectors: bool,
    atoms_per_window: int = 1 << 16,
    threaded_min_atoms: int = 128,
    ntypes: int = 0,
) -> Iterator[tuple[list[tuple], NeighborSearch, WindowPairs]]:
    """``(chunks, search, pairs)`` for windows of chunks of frames ``(..., atom types (N,),
    coords (F, N, 3), boxes or None)``, ``pairs`` their `search_window` by ``search``
    (``ntypes`` > 0: the small cells' neighbours counted, not listed: see there).
    Chunks of frames of fewer than ``threaded_min_atoms`` atoms are searched together by
    ``single``, a window of about ``atoms_per_window`` atoms at a time (so that the small
    cells of many systems share their vectorised passes); larger ones alone, by ``multi``
    (threads)."""
    window: list[tuple] = []
    atoms = 0
    for chunk in chunks:
        coords = chunk[-2]
        if coords.shape[1] >= threaded_min_atoms:
            yield from _searched(window, single, vectors, ntypes)
            yield from _searched([chunk], multi, vectors, ntypes)
            window, atoms = [], 0
            continue
        if window and atoms + coords.shape[0] * coords.shape[1] > atoms_per_window:
            yield from _searched(window, single, vectors, ntypes)
            window, atoms = [], 0
        window.append(chunk)
        atoms += coords.shape[0] * coords.shape[1]
    yield from _searched(window, single, vectors, ntypes)


def _searched(window: list[tuple], search: NeighborSearch, vectors: bool, ntypes: int):
    if window:
        types = [c[-3] for c in window] if ntypes else None
        yield window, search, search_window(search, [c[-2:] for c in window], vectors, types,
                                            ntypes)  # fmt: skip
