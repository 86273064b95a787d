"""ZeRO stage 1 (``training.zero_stage: 1``): the optimiser's state sharded across ranks.

Each parameter has one owner rank (whole parameters, the largest first to the least loaded
rank, as torch's ``ZeroRedundancyOptimizer`` partitions them). Gradients are averaged over
all ranks as without sharding (the same buckets), so every rank holds every averaged
gradient; the owner alone runs the optimiser on its parameters, with the state for them
only, and then broadcasts them. The optimiser updates a parameter from its own gradient and
state, so the weights equal plain data parallelism's to the last bit (tested for Adam, AdamW,
AdaMuon and HybridMuon on CPU; the Muon types orthogonalise same-shape matrices in one
batch, so a BLAS whose batched products round by batch size could differ in the last bits).

Checkpoints hold the state of the whole, unsharded optimiser (`consolidate`, a collective,
gathers it on rank 0 before a save), so a run continues exactly with any number of ranks,
sharded or not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mdtrain import distributed as dist_rt
from mdtrain.train.optimizer import make_optimizer, reserve_state

log = logging.getLogger("mdtrain")

Named = list[tuple[str, torch.Tensor]]


def partition(sizes: list[int], world: int) -> list[int]:
    """The owner rank of each parameter: by size, largest first, to the least loaded rank
    (the lowest rank on a tie)."""
    load = [0] * world
    owner = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        rank = min(range(world), key=lambda r: load[r])
        owner[k] = rank
        load[rank] += sizes[k]
    return owner


def _order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in the order of the optimiser's state_dict indices."""
    return [p for group in optimizer.param_groups for p in group["params"]]


class ShardedOptimizer:
    """The optimiser ``build(named)`` gives, its state sharded over ``world`` ranks.

    ``template``: the whole optimiser, never stepped (so it holds no state): its parameter
    order and hyperparameters are the checkpoints' layout. ``inner``: this rank's part."""

    def __init__(
        self, build: Callable[[Named], torch.optim.Optimizer], named: Named, rank: int, world: int
    ) -> None:
        self.template = build(named)
        self.params = _order(self.template)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.owner = partition([p.numel() for p in self.params], world)
        owned = {id(p) for p, o in zip(self.params, self.owner) if o == rank}
        mine = [(n, p) for n, p in named if id(p) in owned]
        self.inner = build(mine) if mine else None
        self.rank, self.world = rank, world
        self.consolidated: dict | None = None
        # one flat buffer per (owner, dtype, device) for the broadcast after each step
        self.shares: dict[tuple, list[torch.Tensor]] = {}
        for p, o in zip(self.params, self.owner):
            self.shares.setdefault((o, p.dtype, p.device), []).append(p)

    @property
    def param_groups(self) -> list[dict]:
        """The template's groups and this rank's (``lr`` is set in both)."""
        return self.template.param_groups + (self.inner.param_groups if self.inner else [])

    @property
    def state(self) -> dict:
        return self.inner.state if self.inner else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.template.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        """This rank's parameters stepped, then every parameter from its owner."""
        if self.inner is not None:
            self.inner.step()
        self.consolidated = None
        for (owner, dtype, device), params in self.shares.items():
            if owner == self.rank:
                flat = torch.cat([p.reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            dist_rt.broadcast_tensor(flat, owner)
            if owner != self.rank:
                torch._foreach_copy_(params, [v.view_as(p) for v, p in zip(
                    flat.split([p.numel() for p in params]), params)])  # fmt: skip

    # ------------------------------------------------------------------ checkpoints
    def consolidate(self) -> None:
        """Gather the whole optimiser's state on rank 0 (a collective, on every rank)."""
        mine: dict[int, dict] = {}
        if self.inner is not None:
            local = self.inner.state_dict()["state"]
            for i, p in enumerate(_order(self.inner)):
                if i in local:
                    mine[self.index[id(p)]] = {
                        k: v.cpu() if torch.is_tensor(v) else v for k, v in local[i].items()
                    }
        parts = dist_rt.gather_to_main(mine)
        if parts is None:
            self.consolidated = {}
            return
        state: dict[int, dict] = {}
        for part in parts:
            for i, entry in part.items():
                device = self.params[i].device
                state[i] = {k: v.to(device) if torch.is_tensor(v) else v for k, v in entry.items()}
        whole = self.template.state_dict()
        whole["state"] = dict(sorted(state.items()))
        self.consolidated = whole

    def state_dict(self) -> dict:
        """The whole optimiser's state, on rank 0 after `consolidate` (since the last step)."""
        if self.consolidated is None:
            raise RuntimeError("ShardedOptimizer.state_dict() before consolidate()")
        return self.consolidated

    def load_state_dict(self, whole: dict) -> None:
        """This rank's part of a whole optimiser's state (written sharded or not)."""
        saved_groups = whole["param_groups"]
        for group, saved in zip(self.template.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self.inner is None:
            return
        order = _order(self.inner)
        group_of = {i: g for g, saved in enumerate(saved_groups) for i in saved["params"]}
        own = self.inner.state_dict()["param_groups"]
        groups = []
        for group in own:
            first = self.index[id(order[group["params"][0]])]
            saved = saved_groups[group_of[first]]
            groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": group["params"]})  # fmt: skip
        state = {
            i: whole["state"][self.index[id(p)]]
            for i, p in enumerate(order)
            if self.index[id(p)] in whole["state"]
        }
        self.inner.load_state_dict({"state": state, "param_groups": groups})


def describe(stage: int, world: int) -> str:
    """The strategy in force, for the log."""
    if stage == 1 and world > 1:
        return f"ZeRO stage 1: the optimiser state sharded over {world} ranks"
    if stage == 1:
        return "ZeRO stage 1 on one rank: nothing to shard, a plain optimiser"
    return "data parallel without state sharding"


def build_optimizer(
    section: dict | None, named: Named, lr: float, stage: int, rank: int, world: int
) -> torch.optim.Optimizer | ShardedOptimizer:
    """The ``optimizer`` section's optimiser, sharded when ``training.zero_stage`` is 1 and
    there are several ranks (one rank has nothing to shard, as in DeePMD-kit)."""

    def build(part: Named) -> torch.optim.Optimizer:
        return make_optimizer(section, part, lr)

    if stage == 1 and world > 1:
        log.info(describe(stage, world))
        sharded = ShardedOptimizer(build, named, rank, world)
        if sharded.inner is not None:
            reserve_state(sharded.inner)
        return sharded
    if stage == 1:
        log.info(describe(stage, world))
    return build(named)
