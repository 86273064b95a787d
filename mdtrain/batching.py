"""Frames of one system → model-ready tensors (coordinates, neighbour lists, labels).

Neighbour lists are built here, per frame, outside autograd; the model only gathers positions
and adds image shifts. A batch never mixes systems, so every frame has the same atoms. A
``NeighborListCache`` keeps the lists of frames already seen, so that training, which draws
every frame many times, builds each list once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mdtrain.data import System
from mdtrain.data.params import ParamSpec, read_params
from mdtrain.errors import MDTrainError
from mdtrain.neighbors.layout import PER_TYPE, ListLayout

_INPUTS = ("coord", "box", "fparam", "aparam")  # what System.frames gives that is no label


@dataclass
class Batch:
    """Tensors for a batch of frames of one system; labels hold only what the system has."""

    system: str
    coord: torch.Tensor  # (nf, N, 3)
    atype: torch.Tensor  # (N,)
    box: torch.Tensor | None  # (nf, 3, 3)
    nlist: torch.Tensor  # (nf, N, nnei)
    shift: torch.Tensor  # (nf, N, nnei, 3)
    labels: dict[str, torch.Tensor] = field(default_factory=dict)
    fparam: torch.Tensor | None = None  # (nf, numb_fparam) when the model takes them
    aparam: torch.Tensor | None = None  # (nf, N, numb_aparam)

    @property
    def nframes(self) -> int:
        return self.coord.shape[0]

    @property
    def natoms(self) -> int:
        return self.coord.shape[1]

    def inputs(self) -> tuple:
        """The model's arguments: the frame and atomic parameters only for a model with them."""
        if self.fparam is None and self.aparam is None:
            return self.coord, self.atype, self.box, self.nlist, self.shift
        return self.coord, self.atype, self.box, self.nlist, self.shift, self.fparam, self.aparam


@dataclass(frozen=True)
class NeighborLimit:
    """Neighbour counts a training may not meet more of, per type, and where they come from
    (a neighbour-stat file's ``max_nbor_size``, or ``sel`` under ``training.strict_sel``): a
    frame with more is an error, not a list silently cut to ``sel``."""

    counts: tuple[int, ...]
    source: str
    type_map: tuple[str, ...] = ()

    def check(self, counts: np.ndarray, system: str, frame: int) -> None:
        """``counts`` (natoms, ntypes) of one frame, against the limit."""
        found = counts.max(axis=0) if counts.size else np.zeros(len(self.counts), np.int64)
        for t, (n, allowed) in enumerate(zip(found, self.counts)):
            if allowed and int(n) > allowed:
                name = self.type_map[t] if t < len(self.type_map) else t
                raise MDTrainError(
                    f"system {system}, frame {frame}: {int(n)} neighbours of type {name} within "
                    f"rcut, more than {allowed} ({self.source})"
                )


class NeighborListCache:
    """Neighbour lists of frames already seen, kept compactly (int32 indices, int8 image
    shifts when they fit), keyed by system path, frame, rcut and sel.

    Holds at most ``max_bytes``; once full, further frames are simply not kept (training
    draws frames at random, so any kept frame is as likely to come back as another).
    ``ahead``: where lists built in advance wait (training's ``ListPrefetcher``): on a miss,
    its ``take(key)`` gives them (as `compact` makes them), or None and the list is built
    here.
    """

    def __init__(self, max_bytes: int = 1 << 30, limit: NeighborLimit | None = None) -> None:
        self.max_bytes = int(max_bytes)
        self.limit = limit
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._lists: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.ahead = None

    @staticmethod
    def key(system: System, frame: int, layout: ListLayout, rcut: float, sel: list[int]) -> tuple:
        """What identifies one frame's lists."""
        return (system.path, int(frame), layout.name, float(rcut), tuple(int(s) for s in sel))

    def holds(self, key: tuple) -> bool:
        """Whether the lists of ``key`` are kept."""
        return key in self._lists

    def __len__(self) -> int:
        return len(self._lists)

    def get(
        self,
        system: System,
        frame: int,
        coord: np.ndarray,
        box: np.ndarray | None,
        rcut: float,
        sel: list[int],
        layout: ListLayout = PER_TYPE,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(nlist, shift)`` of one frame: ``layout.build``'s values as kept (int32
        indices; int8 shifts when they fit), for a caller that converts them anyway
        (``make_batch``). Not to be modified: a kept frame's arrays are the cache's own."""
        key = self.key(system, frame, layout, rcut, sel)
        kept = self._lists.get(key)
        if kept is not None:
            self.hits += 1
            return kept
        self.misses += 1
        ready = None if self.ahead is None else self.ahead.take(key)
        if ready is None:
            ready = compact(layout.build(coord, box, system.atype, rcut, sel))
        small, small_shift, peak = ready
        if self.limit is not None:
            self.limit.check(peak, system.path, int(frame))
        size = small.nbytes + small_shift.nbytes
        if self.nbytes + size <= self.max_bytes:
            self._lists[key] = (small, small_shift)
            self.nbytes += size
        return small, small_shift


Compact = tuple[np.ndarray, np.ndarray, np.ndarray]


def compact(built: tuple[np.ndarray, np.ndarray, np.ndarray]) -> Compact:
    """``layout.build``'s ``(nlist, shift, counts)`` as the cache keeps them: int32 indices,
    int8 image shifts when they fit, and of the counts only their largest per block (all
    that `NeighborLimit.check` reads). Where lists are built ahead (training's
    ``ListPrefetcher``), this runs there too, not in the step."""
    nlist, shift, counts = built
    fits = shift.size == 0 or int(np.abs(shift).max()) <= np.iinfo(np.int8).max
    peak = counts.max(axis=0, keepdims=True) if counts.size else counts
    return nlist.astype(np.int32), shift.astype(np.int8 if fits else np.int64), peak


def make_batch(
    system: System,
    indices: np.ndarray | list[int],
    rcut: float,
    sel: list[int],
    device: torch.device | str = "cpu",
    cache: NeighborListCache | None = None,
    layout: ListLayout = PER_TYPE,
    params: ParamSpec | None = None,
) -> Batch:
    """Read frames ``indices`` of ``system`` and build their neighbour lists in the model's
    ``layout`` (``mdtrain.neighbors.layout``), or take them from ``cache``; ``params``: the
    frame/atomic parameters the model takes."""
    indices = np.asarray(indices, dtype=np.int64)
    frames = system.frames(indices)
    coord = frames["coord"]
    boxes = frames.get("box")
    lists, shifts = [], []
    for f in range(coord.shape[0]):
        box = None if boxes is None else boxes[f]
        if cache is not None:  # as kept: converted once, by the tensors below
            nlist, shift = cache.get(system, indices[f], coord[f], box, rcut, sel, layout)
        else:
            nlist, shift, _ = layout.build(coord[f], box, system.atype, rcut, sel)
        lists.append(nlist)
        shifts.append(shift)

    cpu = torch.device(device).type == "cpu"

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        out = torch.from_numpy(np.ascontiguousarray(array))
        if cpu and out.dtype == dtype:
            return out  # what ``to`` returns too, without its call (most of a batch's arrays)
        return out.to(device=device, dtype=dtype)

    def stacked(arrays: list[np.ndarray]) -> np.ndarray:
        # one frame (a training step's usual batch): a view, which the conversion copies
        # (the kept lists are int32/int8, the batch's int64/float64), instead of a copy
        if len(arrays) == 1 and arrays[0].flags.writeable:
            return arrays[0][None]
        return np.stack(arrays)

    fparam, aparam = read_params(system, frames, coord.shape[0], params or ParamSpec())
    return Batch(
        system=system.path,
        coord=tensor(coord, torch.float64),
        atype=tensor(system.atype, torch.long),
        box=None if boxes is None else tensor(boxes, torch.float64),
        nlist=tensor(stacked(lists), torch.long),
        shift=tensor(stacked(shifts), torch.float64),
        # every label the system has: the fixed ones and the model's own (DOS, property)
        labels={k: tensor(v, torch.float64) for k, v in frames.items() if k not in _INPUTS},
        fparam=None if fparam is None else tensor(fparam, torch.float64),
        aparam=None if aparam is None else tensor(aparam, torch.float64),
    )
