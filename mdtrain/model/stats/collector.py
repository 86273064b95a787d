"""Descriptor statistics gathered during the neighbour statistics' search (one pass over the
sampled frames instead of two)."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mdtrain.model.config import normalize_model_config
from mdtrain.model.descriptors import StatItem, descriptor_class
from mdtrain.model.stats.pairs import PairStatSums
from mdtrain.model.stats.sampling import stat_batch_plan


class StatCollector:
    """Descriptor statistics gathered while the neighbour statistics search the frames, so
    that the frames the data statistics sample are searched once, not twice (on thousands of
    small systems the search is most of the time to the first step).

    Built from the model config before ``sel`` is known: the sums depend only on the
    descriptor's ``stat_settings`` less ``sel`` (a stand-in descriptor with those, the
    descriptor class's ``stat_stand_in``, evaluates them). ``visit`` is the neighbour statistics' per-frame hook (systems indexed
    as in that pass; the first ``len(systems)`` are the training systems). `items_for` hands
    the items to a model whose lists hold every neighbour seen, else None (then they are
    computed the usual way, e.g. when an explicit ``sel`` truncates the lists).
    """

    def __init__(self, systems: Sequence[Any], model_config: dict, nbatch: int, device) -> None:
        ntypes = len(model_config["type_map"])
        config = copy.deepcopy(model_config)
        config["descriptor"]["sel"] = [1] * ntypes  # not known yet; the sums do not need it
        desc = normalize_model_config(config)["descriptor"]
        self.ntypes = ntypes
        self.key = _env_key(desc)
        stand_in = descriptor_class(desc["type"]).stat_stand_in(desc, ntypes).to(device)
        self.sums = PairStatSums(stand_in, torch.device(device))
        self.plan = stat_batch_plan(systems, nbatch)
        self.limit = [0] * len(systems)  # the sampled frames of system k are 0 .. limit[k]
        for index, _, stop in self.plan:
            self.limit[index] = max(self.limit[index], stop)
        self.atypes = [np.asarray(s.atype, dtype=np.int64) for s in systems]
        self.max_counts: list[int] | None = None  # the search's, once it has finished
        self.seen = 0

    def visit(self, index: int, frame: int, i, j, vec) -> None:
        """One searched frame: half-list pairs ``i``, ``j`` and their vectors (kept as given)."""
        if index >= len(self.limit) or frame >= self.limit[index]:
            return
        self.sums.add_pairs(self.atypes[index], i, j, vec, True)
        self.seen += 1

    def visit_frames(self, systems, frames, sizes, i, j, vec) -> None:
        """Many searched frames (the neighbour statistics' ``visit_frames``): system
        ``systems[k]``'s frame ``frames[k]`` owns the next ``sizes[k]`` pairs; the same sums
        as `visit` frame after frame."""
        limit = np.asarray(self.limit + [0])  # systems past the training ones: none kept
        keep = frames < limit[np.minimum(systems, len(self.limit))]
        if not keep.any():
            return
        if not keep.all():
            chosen = np.repeat(keep, sizes)
            systems, frames, sizes = systems[keep], frames[keep], sizes[keep]
            i, j, vec = i[chosen], j[chosen], vec[chosen]
        atypes = [self.atypes[s] for s in systems.tolist()]
        natoms = np.array([len(a) for a in atypes], dtype=np.int64)
        types = np.concatenate(atypes)
        base = np.repeat(np.cumsum(natoms) - natoms, sizes)
        key = types[base + i] * self.ntypes + types[base + j]
        key *= 2
        key += True  # every pair stands for both directions
        self.sums.add_frames(types, key, vec, sizes)
        self.seen += len(frames)

    def searched(self, max_counts: list[int]) -> None:
        """The largest neighbour counts the search found (over these frames and more)."""
        self.max_counts = [int(n) for n in max_counts]

    def items_for(self, model, plan: list[tuple[int, int, int]]) -> dict[str, StatItem] | None:
        desc = model.descriptor
        complete = self.seen == sum(self.limit) and plan == self.plan
        counts = self.max_counts
        fits = counts is not None and all(n <= s for n, s in zip(counts, desc.sel, strict=True))
        same = self.key == _env_key(normalize_model_config(model.get_model_config())["descriptor"])
        return self.sums.items(desc) if complete and fits and same else None


def _env_key(desc: dict) -> str:
    """What the descriptor statistics depend on besides the frames (and ``sel``)."""
    settings = descriptor_class(desc["type"]).config_stat_settings(desc, len(desc["sel"]))
    settings.pop("sel")
    return json.dumps(settings, sort_keys=True)
