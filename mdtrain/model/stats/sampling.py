"""Which frames the statistics sample (DeePMD's rule: the first ``data_stat_nbatch`` batches
of every system), and those frames as batches with their neighbour lists (fine-tuning
evaluates the model on them)."""

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mdtrain.config.mixed_types import mixed_list
from mdtrain.data.params import ParamSpec, read_params
from mdtrain.data.share import share_ranges
from mdtrain.model.config import normalize_model_config
from mdtrain.model.descriptors import descriptor_class
from mdtrain.model.stats.share import StatShare
from mdtrain.neighbors.layout import list_layout


def auto_batch_size(natoms: int) -> int:
    """Frames per statistics batch: DeePMD's "auto" rule, ceil(32 / natoms)."""
    return max(1, math.ceil(32 / natoms))


def stat_batch_plan(
    systems: Sequence[Any], nbatch: int, batch_size: int | None = None
) -> list[tuple[int, int, int]]:
    """``(system index, first frame, stop)`` of every statistics batch, in order: the first
    ``min(nbatch, nbatches)`` batches of ``batch_size`` consecutive frames of every system
    (default ``ceil(32/natoms)``, DeePMD's "auto" batch size)."""
    plan = []
    for index, system in enumerate(systems):
        bs = batch_size or auto_batch_size(system.natoms)
        nframes = min(nbatch * bs, int(system.nframes))
        plan += [(index, a, min(a + bs, nframes)) for a in range(0, nframes, bs)]
    return plan


def my_stat_plan(
    systems: Sequence[Any],
    nbatch: int,
    batch_size: int | None = None,
    share: StatShare | None = None,
) -> list[tuple[int, int, int]]:
    """``stat_batch_plan``, or this rank's contiguous share of it when ``share`` splits the
    work (balanced by atoms)."""
    plan = stat_batch_plan(systems, nbatch, batch_size)
    if share is not None and share.world > 1:
        natoms = [int(systems[index].natoms) for index, _, _ in plan]
        groups = [(1, (stop - start) * n) for (_, start, stop), n in zip(plan, natoms)]
        mine = share_ranges(groups, share.rank, share.world)
        plan = [item for item, taken in zip(plan, mine, strict=True) if len(taken)]
    return plan


def stat_frames(systems: Sequence[Any], plan: list[tuple[int, int, int]], positions=True):
    """``(system, first frame, frames)`` for every system of ``plan``: the frames its
    batches use (consecutive), read once per system: energies, and the positions and
    cells when ``positions``."""
    for index, items in itertools.groupby(plan, key=lambda item: item[0]):
        system = systems[index]
        spans = [(start, stop) for _, start, stop in items]
        first, rows = spans[0][0], np.arange(spans[0][0], spans[-1][1])
        yield system, first, system.frames(rows, labels=("energy",), positions=positions)


def collect_stat_batches(
    systems: Sequence[Any],
    model_config: dict,
    nbatch: int,
    batch_size: int | None = None,
    share: StatShare | None = None,
    cut: tuple[float, list[int], bool] | None = None,
) -> list[dict[str, Any]]:
    """The batches of ``stat_batch_plan`` with their neighbour lists (this rank's share of
    them when ``share`` splits the work; all of them by default). The lists are the
    descriptor's, or with ``cut`` ``(rcut, sel, mixed_types)`` a built model's own (a
    combined model's outer list, which its config has no descriptor to give).

    Sampling is deterministic. Each batch is a dict of numpy arrays: ``coord`` (nf,N,3),
    ``box`` (nf,3,3) or None, ``atype`` (N,), ``nlist``, ``shift``, ``natoms_per_type``
    (ntypes,), ``energy`` (nf,) when the system has energies, ``system``, and ``params``
    (fparam, aparam) for a model with frame/atomic parameters.
    """
    if cut is None:
        cfg = normalize_model_config(model_config)
        desc = cfg["descriptor"]
        rcut, sel = descriptor_class(desc["type"]).list_cut(desc)
        layout = list_layout(mixed_list(desc))  # the model's lists: per type or type-mixed
    else:
        cfg, (rcut, sel, mixed) = model_config, cut
        layout = list_layout(mixed)
    ntypes = len(cfg["type_map"])
    plan = my_stat_plan(systems, nbatch, batch_size, share)
    spec = ParamSpec.of(cfg)
    batches = []
    for index, items in itertools.groupby(plan, key=lambda item: item[0]):
        system = systems[index]
        spans = [(start, stop) for _, start, stop in items]
        first = spans[0][0]
        data = system.frames(np.arange(first, spans[-1][1]))  # one read per system
        atype = np.asarray(system.atype, dtype=np.int64)
        has_energy = "energy" in data and (not hasattr(system, "has") or system.has("energy"))
        params = read_params(system, data, spans[-1][1] - first, spec)
        for begin, end in spans:
            start, stop = begin - first, end - first
            coord = np.asarray(data["coord"][start:stop], dtype=np.float64)
            box = data.get("box")
            box = None if box is None else np.asarray(box[start:stop], dtype=np.float64)
            lists = [
                layout.build(coord[f], None if box is None else box[f], atype, rcut, sel)
                for f in range(stop - start)
            ]
            batch = {
                "system": str(getattr(system, "path", "")),
                "coord": coord,
                "box": box,
                "atype": atype,
                "nlist": np.stack([nl for nl, _, _ in lists]),
                "shift": np.stack([sh for _, sh, _ in lists]),
                "natoms_per_type": np.bincount(atype, minlength=ntypes)[:ntypes],
            }
            if spec.any:  # (fparam, aparam) as the model takes them, None where it takes none
                batch["params"] = tuple(None if p is None else p[start:stop] for p in params)
            if has_energy:
                batch["energy"] = np.asarray(data["energy"][start:stop], dtype=np.float64)
            batches.append(batch)
    return batches


def model_device(model) -> torch.device:
    """Where the model's buffers live: statistics compute there, next to ``pair_keep``."""
    return model.descriptor.davg.device


def stat_inputs(
    batch: dict[str, Any], start: int, stop: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Frames ``start:stop`` of a statistics batch as model inputs on ``device``: coord, box
    (or None), atype, nlist, shift."""

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype, device=device)

    box = batch.get("box")
    return (
        tensor(batch["coord"][start:stop], torch.float64),
        None if box is None else tensor(box[start:stop], torch.float64),
        tensor(batch["atype"], torch.long),
        tensor(batch["nlist"][start:stop], torch.long),
        tensor(batch["shift"][start:stop], torch.long),
    )
