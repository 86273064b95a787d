"""The neighbour lists of the coming batches, built in a background thread while the current
step computes, so that a first-epoch step (every frame new, every list searched) costs what a
later one costs (every list from the cache).

Nothing the run computes changes. The samplers are only peeked at (`TrainingSampler.peek`
draws from a copy), so the batches, their order, the checkpoints and restarts are those of a
run without prefetching. The step still asks the neighbour-list cache for every frame
(`NeighborListCache.get`); on a miss the cache takes the list built here, waiting for one
being built, and builds it itself as before when it is not there (a guess that missed: a
batch grown by the batch controller, a restart). The lists are ``layout.build``'s of the same
frame either way, and the cache checks the neighbour counts in the step, so a frame with too
many neighbours fails at the same step with the same message; a frame whose search fails
here is simply searched again in the step, which raises as before.

A thread, not a process: the search (vesin through ctypes) and numpy's sorts release the
interpreter lock, and so do the step's torch operations; measured
(``benchmarks/first_epoch.py --paired-steps``), the training thread blocks well under once a
step while this thread builds, and spends no more CPU than with every list cached. The
lists are handed over as the cache keeps them (``batching.compact``, made here), so the
step only stores them. The frames' positions are read on the calling thread (`plan`), so
the data stores see one thread only. Memory is bounded: the thread holds the lists of the
batches last planned (the current one and ``depth`` ahead); anything else is dropped at the
next `plan`.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from mdtrain.batching import Compact, NeighborListCache, compact
from mdtrain.data import System
from mdtrain.neighbors.layout import ListLayout
from mdtrain.train.sampler import TrainingSampler

DEFAULT_DEPTH = 2  # batches ahead: one is enough in a steady run, two absorb a slow frame


class ListPrefetcher:
    """Builds the neighbour lists of planned frames in one daemon thread, for ``cache``.

    ``lists``: the models' ``(rcut, sel, layout)``. Call `plan` once a step with the batches
    to come (the current one first), `close` at the end (`plan` starts the thread again)."""

    def __init__(self, cache: NeighborListCache, lists: tuple[float, list[int], ListLayout]):
        self.cache = cache
        self.rcut, self.sel, self.layout = float(lists[0]), list(lists[1]), lists[2]
        self._cond = threading.Condition()
        self._queue: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (coord, box, atype)
        self._ready: dict[tuple, Compact | None] = {}  # None: failed here, the step retries
        self._wanted: set[tuple] = set()
        self._busy: tuple | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._complete = False  # the cache holds every training frame's lists (for good)
        self._cursor = (0, 0)  # the first (system, frame) not found kept at the last look
        self._looked_at = -1  # the cache's size at that look
        self.searched = 0  # frames searched here, lists built or not (tests, benchmarks)
        self.built = 0  # lists built here
        self.used = 0  # of them, taken by the step

    def _key(self, system: System, frame: int) -> tuple:
        return self.cache.key(system, frame, self.layout, self.rcut, self.sel)

    def lists_complete(self, systems: Sequence[System]) -> bool:
        """Whether the cache holds the lists of every frame of ``systems`` (the training
        systems, the same list at every call). Then no step has anything to build ahead and
        the trainer skips the lookahead and `plan` (about 0.15 ms of the training thread a
        step); the cache never drops a list, so this stays true. Looks only when the cache
        has grown, from the first frame not found at the last look: each frame is found
        once in a run."""
        if self._complete:
            return True
        size = len(self.cache)
        if size == self._looked_at:
            return False
        self._looked_at = size
        index, frame = self._cursor
        while index < len(systems):
            system = systems[index]
            while frame < system.nframes:
                if not self.cache.holds(self._key(system, frame)):
                    self._cursor = (index, frame)
                    return False
                frame += 1
            index, frame = index + 1, 0
        self._complete = True
        with self._cond:  # what was built ahead is kept already: nothing will take it
            self._wanted = set()
            self._queue.clear()
            self._ready.clear()
        return True

    def plan(self, batches: Iterable[tuple[System, np.ndarray]]) -> None:
        """The frames of ``batches`` (in the order the steps will take them) not yet in the
        cache are built next; what an earlier plan wanted and this one does not is dropped."""
        order: OrderedDict[tuple, tuple[System, int]] = OrderedDict()
        for system, frames in batches:
            for frame in np.asarray(frames, dtype=np.int64).tolist():
                key = self._key(system, frame)
                if key not in order and not self.cache.holds(key):
                    order[key] = (system, frame)
        with self._cond:
            self._wanted = set(order)
            for stale in [k for k in self._queue if k not in order]:
                del self._queue[stale]
            for stale in [k for k in self._ready if k not in order]:
                del self._ready[stale]
            known = set(self._queue) | set(self._ready) | {self._busy}
        new = [(key, *where) for key, where in order.items() if key not in known]
        jobs = self._read(new)  # on this thread: the data stores see one thread only
        with self._cond:
            for key, job in jobs:
                if key in self._wanted:
                    self._queue[key] = job
            self._cond.notify_all()
        if jobs and (self._thread is None or not self._thread.is_alive()):
            self._start()

    @staticmethod
    def _read(new: list[tuple[tuple, System, int]]) -> list[tuple[tuple, tuple]]:
        """Positions and cells of the new frames, one read per system."""
        jobs = []
        by_system: dict[int, list[tuple[tuple, System, int]]] = {}
        for item in new:
            by_system.setdefault(id(item[1]), []).append(item)
        for items in by_system.values():
            system = items[0][1]
            frames = system.frames([frame for _, _, frame in items], labels=())
            boxes = frames.get("box")
            for n, (key, _, _) in enumerate(items):
                box = None if boxes is None else boxes[n]
                jobs.append((key, (frames["coord"][n], box, system.atype)))
        return jobs

    def take(self, key: tuple) -> Compact | None:
        """The lists of ``key`` built here, as the cache keeps them (``batching.compact``,
        done here too: the step only stores them), waiting while they are being built; or
        None when they are not: the caller builds them itself."""
        with self._cond:
            if self._queue.pop(key, None) is not None:
                return None  # not started: building it now beats waiting behind others
            while self._busy == key:
                self._cond.wait()
            built = self._ready.pop(key, None)
            if built is not None:
                self.used += 1
            return built

    def pending(self) -> int:
        """Frames planned and not yet taken (queued, being built, or built)."""
        with self._cond:
            return len(self._queue) + len(self._ready) + (self._busy is not None)

    def _start(self) -> None:
        self._stop = False
        # the thread holds the prefetcher weakly: one that is dropped without `close` (a
        # trainer stepped by hand, not by the training loop) is freed and its thread ends
        ref = weakref.ref(self)
        self._thread = threading.Thread(
            target=_work, args=(ref,), name="mdtrain-nlist", daemon=True
        )
        self._thread.start()

    def _work_once(self) -> bool:
        """Build the next queued frame, waiting at most ``_IDLE_S`` for one; False once
        closed."""
        with self._cond:
            if not self._queue and not self._stop:
                self._cond.wait(timeout=_IDLE_S)
            if self._stop:
                return False
            if not self._queue:
                return True
            key, (coord, box, atype) = self._queue.popitem(last=False)
            self._busy = key
        try:
            built: Compact | None = compact(
                self.layout.build(coord, box, atype, self.rcut, self.sel)
            )
        except Exception:  # noqa: BLE001 - the step searches again and reports it
            built = None
        with self._cond:
            self._busy = None
            self.searched += 1
            if key in self._wanted:
                self._ready[key] = built
                self.built += built is not None
            self._cond.notify_all()
        return True

    def close(self) -> None:
        """Stop the thread (after the frame it is building) and drop everything planned."""
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._ready.clear()
            self._wanted = set()
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()


_IDLE_S = 1.0  # how long an idle thread keeps its prefetcher alive between looks


def _work(ref: weakref.ReferenceType[ListPrefetcher]) -> None:
    """The thread: works while its prefetcher exists and is not closed."""
    while (prefetcher := ref()) is not None and prefetcher._work_once():
        del prefetcher


def coming(
    systems: list[System],
    samplers: list[TrainingSampler],
    current: list[tuple[int, np.ndarray]],
    depth: int,
    scale: int = 1,
) -> list[tuple[System, np.ndarray]]:
    """The batches of this step (``current``: each sampler's draw) and of the ``depth`` steps
    after it, step by step, as ``(system, frames)``; ``scale``: the batch controller's."""
    return Lookahead(systems).batches(samplers, current, depth, scale)


class Lookahead:
    """`coming`, kept from one step to the next: each sampler's copy (``copy_ahead``) stays
    ahead and draws one more batch a step, instead of a fresh copy (its random generator
    copied) and ``depth`` draws every step. A step whose draw is not the one foreseen (a
    restart, another batch scale) starts afresh. A wrong guess could only make the step
    build a list itself: lists are found by frame, never by guess."""

    def __init__(self, systems: list[System]) -> None:
        self.systems = systems
        # per sampler: the sampler, the scale, its copy, the copy's draws not yet reached
        self._kept: list[tuple[TrainingSampler, int, TrainingSampler, list] | None] = []

    def batches(self, samplers: list[TrainingSampler], current: list, depth: int, scale: int = 1):
        """As `coming` for these systems: ``(system, frames)`` of this step's draws
        (``current``) and of the ``depth`` steps after them."""
        depth = max(0, depth)
        if len(self._kept) != len(samplers):
            self._kept = [None] * len(samplers)
        ahead = []
        for k, (sampler, now) in enumerate(zip(samplers, current, strict=True)):
            kept = self._kept[k]
            if (
                kept is not None
                and kept[0] is sampler
                and kept[1] == scale
                and _foreseen(kept[3], now)
            ):
                copy, draws = kept[2], kept[3][1:]
            elif depth == 0:  # nothing to foresee (the run's last step)
                self._kept[k] = None
                ahead.append([])
                continue
            else:
                copy, draws = sampler.copy_ahead(), []
            while len(draws) < depth:
                draws.append(copy.next_batch(scale))
            self._kept[k] = (sampler, scale, copy, draws)
            ahead.append(draws[:depth])
        steps = [current, *zip(*ahead)]
        return [(self.systems[index], frames) for step in steps for index, frames in step]


def _foreseen(draws: list[tuple[int, np.ndarray]], now: tuple[int, np.ndarray]) -> bool:
    return bool(draws) and draws[0][0] == now[0] and np.array_equal(draws[0][1], now[1])
