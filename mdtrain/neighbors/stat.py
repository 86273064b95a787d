"""Neighbour statistics: the smallest interatomic distance and the largest neighbour counts.

Definitions (DeePMD-compatible), over every frame of every system:

- ``min_nbor_dist``: the smallest distance between two atoms, periodic images included (an
  atom's own images too, when a cell vector is shorter than rcut);
- ``max_nbor_size[t]``: the largest number of type-``t`` neighbours that any atom has within
  rcut (strictly closer than rcut; images included; the atom itself excluded, its images
  counted);
- ``max_nbor_total``: the largest number of neighbours of all types together that any atom
  has (what a mixed-types descriptor's one ``sel`` must hold: DeePMD's ``mixed_type`` count);
- ``sel``: ``auto_sel(max_nbor_size, ratio)``, the per-type list sizes of the model.

Work and memory are O(atoms × neighbours) per frame: the pairs come from the cell list in
``nlist``, counted with ``np.bincount``; no N×N matrix is ever built.

Two atoms closer than ``stat_count.OVERLAP_DISTANCE`` (1e-3 Å) are taken as a data error (a duplicated
atom, or a cell vector of length zero): the stage stops and names the system and frame.

Ranks that split the frames (``training.distributed.stat_mode: "shard"``) each compute a
``NeighborPartial`` of their frames and combine them element by element (max, min, sums):
the same numbers as one process searching every frame.

``sel`` rules live in ``sel``, the JSON file in ``stat_file``, data fingerprints in
``fingerprint``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mdtrain.errors import MDTrainError
from mdtrain.neighbors.nlist import NeighborSearch
from mdtrain.neighbors.stat_count import WindowStat, count_chunk, count_window
from mdtrain.neighbors.stat_result import NeighborStat, SystemNeighborStat
from mdtrain.neighbors.window import search_chunks, search_window
from mdtrain.progress import progress as progress_bar

log = logging.getLogger("mdtrain.neighbors")

_ATOMS_PER_READ = 1 << 16  # frames are read in chunks of about this many atoms
_MAX_FRAMES_PER_READ = 256
_THREADED_MIN_ATOMS = 128  # smaller frames are searched faster by a single thread


# ----------------------------------------------------------------------------------------
# computation


def _frame_chunks(rows: range, natoms: int) -> list[np.ndarray]:
    step = max(1, min(_MAX_FRAMES_PER_READ, _ATOMS_PER_READ // max(natoms, 1)))
    if 0 < len(rows) <= step:  # one chunk (small systems)
        return [np.arange(rows.start, rows.stop)]
    return [np.arange(a, min(a + step, rows.stop)) for a in range(rows.start, rows.stop, step)]


def default_threads() -> int:
    """Threads for the neighbour search: the usable cores, capped by OMP_NUM_THREADS and 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    limit = os.environ.get("OMP_NUM_THREADS", "")
    if limit.isdigit() and int(limit) > 0:
        cores = min(cores, int(limit))
    return max(1, min(cores, 8))


class _Totals:
    """Running statistics of every system over its frames ``rows[s]``, merged a window of
    chunks at a time (arrays over the systems)."""

    def __init__(self, systems: Sequence, ntypes: int, rows: Sequence[range] | None) -> None:
        self.systems = systems
        self.rows = [range(int(s.nframes)) for s in systems] if rows is None else list(rows)
        self.atypes = [np.asarray(s.atype, dtype=np.int64) for s in systems]
        _check_types(systems, self.atypes, ntypes)
        self.min_dist = np.full(len(systems), math.inf)
        self.max_counts = np.zeros((len(systems), ntypes), dtype=np.int64)
        self.max_total = np.zeros(len(systems), dtype=np.int64)
        self.lonely: dict[int, list[int]] = {}  # system -> frames where some atom is alone

    def merge(self, which: list[int], found: WindowStat) -> None:
        """Merge the statistics of a window's chunks, chunk ``c`` of system ``which[c]``."""
        index = np.asarray(which, dtype=np.int64)
        np.minimum.at(self.min_dist, index, found.min_dist)
        np.maximum.at(self.max_counts, index, found.max_counts)
        np.maximum.at(self.max_total, index, found.max_total)
        for c, frames in found.lonely.items():
            self.lonely.setdefault(which[c], []).extend(frames)

    def partial(self) -> NeighborPartial:
        lonely = [self.lonely.get(k, []) for k in range(len(self.systems))]
        return NeighborPartial(
            min_dist=self.min_dist,
            max_counts=self.max_counts,
            lonely=np.array([len(f) for f in lonely], dtype=np.int64),
            first_lonely=np.array(
                [min(f, default=int(s.nframes)) for f, s in zip(lonely, self.systems)],
                dtype=np.int64,
            ),
            searched=np.array([len(r) for r in self.rows], dtype=np.int64),
            max_total=self.max_total,
        )


def _check_types(systems: Sequence, atypes: list[np.ndarray], ntypes: int) -> None:
    """Every atom type indexes the type map; else the first system that does not is named."""
    if not atypes or any(len(a) == 0 for a in atypes):
        checks = [(s, a) for s, a in zip(systems, atypes, strict=True) if len(a)]
    else:  # all systems at once; the loop below only finds the culprit
        every = np.concatenate(atypes)
        ok = every.min() >= 0 and every.max() < ntypes
        checks = [] if ok else list(zip(systems, atypes, strict=True))
    for system, atype in checks:
        if atype.min() < 0 or atype.max() >= ntypes:
            raise MDTrainError(
                f"system {system.path}: atom types go up to {int(atype.max())} but "
                f"the type_map has {ntypes} types"
            )


@dataclass
class NeighborPartial:
    """Per-system statistics of some of the frames: what ranks that split the frames combine,
    element by element, into the statistics of all of them (``COMBINE`` names the operation
    of each field), exactly whatever the split."""

    min_dist: np.ndarray  # (nsystems,) float64, inf where no pair was found
    max_counts: np.ndarray  # (nsystems, ntypes) int64
    lonely: np.ndarray  # (nsystems,) int64: frames where some atom has no neighbour
    first_lonely: np.ndarray  # (nsystems,) int64: the first such frame, nframes when none
    searched: np.ndarray  # (nsystems,) int64: frames searched
    max_total: np.ndarray  # (nsystems,) int64: neighbours of all types together

    COMBINE = {
        "min_dist": "min",
        "max_counts": "max",
        "lonely": "sum",
        "first_lonely": "min",
        "searched": "sum",
        "max_total": "max",
    }


def neighbor_stat_partial(
    systems: Sequence,
    rcut: float,
    ntypes: int,
    progress: bool = True,
    threads: int | None = None,
    rows: Sequence[range] | None = None,
    desc: str = "neighbour statistics",
    visit: Callable | None = None,
    visit_frames: Callable | None = None,
) -> NeighborPartial:
    """Neighbour statistics of the frames ``rows[s]`` of each system ``s`` (default: all).

    Frames are read in chunks, searched a window of many chunks at a time
    (`window.search_window`: the small cells of many systems together) and counted a
    window at a time (`stat_count`); frames of ``_THREADED_MIN_ATOMS`` atoms or more use
    ``threads`` threads of the compiled search (default: ``default_threads()``). The result
    does not depend on the number of threads.
    ``visit(s, frame, i, j, vec)``, when given, sees every frame searched, with its
    half-list pairs and their vectors (``j``'s image minus ``i``), so that other statistics
    of the same frames need no search of their own (arrays the visitor may keep).
    ``visit_frames(s, frame, sizes, i, j, vec)`` sees the same frames many at a time, in the
    same order: system ``s[k]``'s frame ``frame[k]`` owns the next ``sizes[k]`` pairs.
    """
    if not rcut > 0 or not math.isfinite(rcut):
        raise MDTrainError(f"rcut must be a positive number of Å, got {rcut}")
    if ntypes < 1:
        raise MDTrainError("neighbour statistics need at least one atom type")
    if rows is not None and len(rows) != len(systems):
        raise ValueError(f"{len(rows)} frame ranges for {len(systems)} systems")
    rcut = float(rcut)
    totals = _Totals(systems, ntypes, rows)
    nframes = sum(len(r) for r in totals.rows)
    threads = default_threads() if threads is None else max(1, int(threads))
    single, multi = NeighborSearch(rcut), NeighborSearch(rcut, threads)
    passes = _run(totals, ntypes, single, multi, visit, visit_frames)
    for _ in progress_bar(passes, nframes, desc, progress):
        pass
    return totals.partial()


def neighbor_stat_result(
    systems: Sequence,
    rcut: float,
    partial: NeighborPartial,
    fingerprints: bool = True,
    report: bool = True,
) -> NeighborStat:
    """The statistics of ``systems`` from the partial statistics of all their frames.

    ``fingerprints``: hash each system's data for the JSON file (a pass over all
    coordinates; not needed for ``sel``). ``report``: log the warnings (one rank does).
    """
    results = []
    # Python numbers of every system at once (numpy's scalars one by one cost more)
    lonely, first_lonely = partial.lonely.tolist(), partial.first_lonely.tolist()
    min_dist, max_counts = partial.min_dist.tolist(), partial.max_counts.tolist()
    max_total = partial.max_total.tolist()
    for k, system in enumerate(systems):
        if lonely[k] and report:
            log.warning(
                "system %s: some atom has no neighbour within rcut = %g Å (frame %d; %d of "
                "%d frames)", system.path, rcut, first_lonely[k], lonely[k], system.nframes,
            )  # fmt: skip
        results.append(
            SystemNeighborStat(
                path=system.path,
                nframes=int(system.nframes),
                natoms=int(system.natoms),
                min_nbor_dist=min_dist[k],
                max_nbor_size=max_counts[k],
                fingerprint=dict(system.fingerprint()) if fingerprints else {},
                max_nbor_total=max_total[k],
            )
        )
    ntypes = partial.max_counts.shape[1]
    max_counts = partial.max_counts.max(axis=0) if len(results) else np.zeros(ntypes, int)
    min_dist = float(partial.min_dist.min()) if len(results) else math.inf
    if not math.isfinite(min_dist) and report:
        log.warning("no two atoms were found in any frame: min_nbor_dist is undefined")
    return NeighborStat(
        rcut=float(rcut),
        min_nbor_dist=min_dist,
        max_nbor_size=[int(n) for n in max_counts],
        systems=results,
        max_nbor_total=int(partial.max_total.max()) if len(results) else 0,
    )


def compute_neighbor_stat(
    systems: Sequence,
    rcut: float,
    ntypes: int,
    progress: bool = True,
    threads: int | None = None,
    visit: Callable | None = None,
    fingerprints: bool = True,
    visit_frames: Callable | None = None,
) -> NeighborStat:
    """Neighbour statistics of ``systems`` (``mdtrain.data.System``) at cutoff ``rcut``, every
    frame searched here (see ``neighbor_stat_partial``; ``fingerprints``: see
    ``neighbor_stat_result``)."""
    partial = neighbor_stat_partial(
        systems, rcut, ntypes, progress, threads, visit=visit, visit_frames=visit_frames
    )
    return neighbor_stat_result(systems, rcut, partial, fingerprints)


def _run(totals: _Totals, ntypes: int, single, multi, visit=None, visit_frames=None):
    """Read, count and merge every chunk of frames; yields once per frame (for progress).
    Without a visitor, the small cells' pairs are counted, not listed (`search_window`)."""
    sizes = (_ATOMS_PER_READ, _THREADED_MIN_ATOMS)
    vectors = visit is not None or visit_frames is not None
    counting = 0 if vectors else ntypes  # no visitor: small cells counted, not listed
    windows = search_chunks(_read_chunks(totals), single, multi, vectors, *sizes, counting)
    for window, search, pairs in windows:
        which = [c[0] for c in window]
        found = count_window([totals.atypes[k] for k in which], [c[1] for c in window], pairs,
                             ntypes)  # fmt: skip
        if found is None:  # frame by frame, chunk by chunk: the first problem is reported
            if pairs.counted:  # which needs every frame's pairs listed
                pairs = search_window(search, [c[-2:] for c in window], vectors)
            chunks = []
            for (k, rows, _, coords, boxes), searched in zip(window, pairs.per_frame()):
                seen = _frame_visitor(k, visit, visit_frames)
                chunks.append(count_chunk(single.rcut, totals.systems[k].path, totals.atypes[k],
                                          ntypes, rows, coords, boxes, seen, searched))  # fmt: skip
            found = WindowStat.of_chunks(chunks, ntypes)
        elif vectors:
            _visit_window(window, pairs, which, visit, visit_frames)
        totals.merge(which, found)
        for _, rows, *_ in window:
            yield from rows


def _frame_visitor(system: int, visit, visit_frames) -> Callable | None:
    """``visit(frame, i, j, vec)`` of one system's frames, for `count_chunk`."""
    if visit is None and visit_frames is None:
        return None

    def seen(frame: int, i, j, vec) -> None:
        if visit is not None:
            visit(system, frame, i, j, vec)
        if visit_frames is not None:
            visit_frames(np.array([system]), np.array([frame]), np.array([len(i)]), i, j, vec)

    return seen


def _visit_window(window: list[tuple], pairs, systems: list[int], visit, visit_frames) -> None:
    """The visitors' view of a window's frames, in order (system by system, frame by frame)."""
    lengths = np.diff(pairs.starts)
    if visit_frames is not None:
        whole = pairs.frame_order()
        frames = np.concatenate([c[1] for c in window])
        visit_frames(np.repeat(systems, lengths), frames, pairs.sizes, whole.i, whole.j,
                     whole.vec)  # fmt: skip
    if visit is not None:
        for (_, rows, *_), system, searched in zip(window, systems, pairs.per_frame(),
                                                       strict=True):  # fmt: skip
            for frame, (i, j, _, vec) in zip(rows.tolist(), searched, strict=True):
                visit(system, frame, i, j, vec)


def _read_chunks(totals: _Totals):
    """(system index, frame indices, atom types, coords (n, natoms, 3), boxes (n, 3, 3) or
    None)."""
    for k, (system, frames) in enumerate(zip(totals.systems, totals.rows, strict=True)):
        for rows in _frame_chunks(frames, int(system.natoms)):
            data = system.frames(rows, labels=())  # positions and cells only
            coords = np.ascontiguousarray(data["coord"], dtype=np.float64)
            boxes = data.get("box") if system.periodic else None
            boxes = None if boxes is None else np.ascontiguousarray(boxes, dtype=np.float64)
            yield k, rows, totals.atypes[k], coords, boxes
