"""The training step of a run's models, a single run being one model: sample a batch, one
forward of the models that drew it, their losses' backward (micro-batched on OOM), one set of
gradient buckets averaging every model's gradients over the ranks, the optimiser steps; and
one validation. Every rank takes every decision (retry, stop) together.

A run trains K models (``--ensemble K``; K = 1 a single run). Member k is exactly the single
run of ``committee.member_config(config, k, sampling)``: its own model, optimiser, samplers and
outputs (`mdtrain.train.member.Member`, in the run's folder or ``member-k/``). Members that
draw the same frames (all of them, with "shared" sampling) form one *group*: the group's
batch is made once and evaluated by one forward of the committee model (the accelerated one
computes the environment once for all members and batches their networks), the sum of the
members' losses takes one backward (the members share no parameter, so each gets exactly its
own gradient), and the optimisers step in one fused call. With "per-member" sampling every
member is a group of its own. The loop around the steps (display, validation cadence,
checkpoints, preemption) is `TrainingLoop`'s.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from mdtrain import distributed as dist_rt
from mdtrain.batching import Batch, NeighborListCache, make_batch
from mdtrain.data import System
from mdtrain.data.labels import output_labels
from mdtrain.data.params import ParamSpec, check_params
from mdtrain.distributed import Runtime
from mdtrain.errors import MDTrainError
from mdtrain.memory import InferenceChunker, maybe_simulate_oom
from mdtrain.model.committee import members_of, stats_shared
from mdtrain.neighbors.layout import layout_of
from mdtrain.train.adam_step import AdamSteps
from mdtrain.train.batch_controller import MicroBatchController, frame_weights
from mdtrain.train.batch_sums import step_sums
from mdtrain.train.committee import SHARED, committee_tag, member_config
from mdtrain.train.ema import warn_short_average
from mdtrain.train.loss import ErrorAccumulator, check_labels, merge_metrics
from mdtrain.train.loss_scale import LossScaler
from mdtrain.train.member import Member
from mdtrain.train.precision import check_networks, committee_problem, mode_of
from mdtrain.train.prefetch import DEFAULT_DEPTH, ListPrefetcher, Lookahead
from mdtrain.train.resume import member_dirs
from mdtrain.train.sampler import make_sampler
from mdtrain.train.training_loop import TrainingLoop

__all__ = ["Trainer", "make_sampler", "seed_everything"]  # make_sampler: its old home

log = logging.getLogger("mdtrain")


class Trainer(TrainingLoop):
    """Trains ``model``: one model, or a ``Committee`` whose member k is the single run of
    ``member_config(config, k, sampling)``; ``run()`` trains to numb_steps.

    ``nlist_cache``: the neighbour-list cache to use; ``checkpoint_extra``: entries every
    checkpoint gets."""

    def __init__(
        self,
        config: dict,
        model: torch.nn.Module,
        train_systems: list[System],
        valid_systems: list[System],
        runtime: Runtime,
        out_dir: str = ".",
        nlist_cache: NeighborListCache | None = None,
        sampling: str = SHARED,
        checkpoint_extra: dict | None = None,
    ) -> None:
        self.config, self.model, self.rt, self.out_dir = config, model, runtime, out_dir
        self.train_systems, self.valid_systems = train_systems, valid_systems
        training = config["training"]
        models = members_of(model)
        size = len(models)
        if problem := committee_problem(training.get("mixed_precision"), size):
            raise MDTrainError(problem)  # --ensemble given on the command line
        outputs = output_labels(config["model"])
        check_labels(config["loss"], [*train_systems, *valid_systems], outputs)
        self.param_spec = ParamSpec.of(config["model"])
        for system in [*train_systems, *valid_systems]:  # before any step: one line if not
            check_params(system, self.param_spec)
        self.precision = mode_of(training.get("mixed_precision"))  # None, tf32, bf16, fp16
        check_networks(
            training.get("mixed_precision"), models[0].get_model_config(),
            "training.mixed_precision",
        )  # fmt: skip
        self.scaler = LossScaler() if self.precision == "fp16" else None  # float16 underflows
        self.step = 0
        # the models' neighbour lists: cut-off, sel (per type, or [total] for a type-mixed
        # list; a hybrid's largest) and layout (``mdtrain.neighbors.layout``), chosen once
        self.lists = (float(models[0].rcut), list(models[0].sel), layout_of(models[0]))
        # frames come back many times: search once
        self.nlist_cache = NeighborListCache() if nlist_cache is None else nlist_cache
        # the coming batches' lists, built while the step computes (``prefetch.py``)
        self.prefetch_depth = int(training.get("nlist_prefetch", DEFAULT_DEPTH))
        self.prefetch = (
            ListPrefetcher(self.nlist_cache, self.lists) if self.prefetch_depth else None
        )
        self.nlist_cache.ahead = self.prefetch
        self.lookahead = Lookahead(train_systems)  # the samplers' coming draws, kept
        self.disp_freq = int(training["disp_freq"])
        self.save_freq = int(training["save_freq"])
        self.max_norm = training.get("gradient_max_norm")
        folders = member_dirs(out_dir, size)
        extra = checkpoint_extra or {}
        self.members = [
            Member(self, member_config(config, k, sampling), m, folders[k],
                   {**committee_tag(size, k, sampling), **extra})
            for k, m in enumerate(models)
        ]  # fmt: skip
        for member in self.members:  # the outputs each member's training step needs
            reads = getattr(member.loss, "reads", None)
            if reads is not None and hasattr(member.model, "train_outputs"):
                member.model.train_outputs(reads())
        first = self.members[0]
        self.numb_steps, self.lr, self.loss = first.numb_steps, first.lr, first.loss
        warn_short_average(training, self.numb_steps)
        # members that draw the same frames, evaluated by one forward
        self.groups = [list(range(size))] if sampling == SHARED else [[k] for k in range(size)]
        self.params = [p for m in self.members for p in m.params]
        self.adam = AdamSteps([m.optimizer for m in self.members])  # the update, fused
        self.controller = self._controller(training, first)
        spread = training.get("distributed", {})
        self.overlap_comm = runtime.world_size > 1 and bool(spread.get("overlap_comm", True))
        self.grad_buckets = (  # allocated once: no allocation on the way into a collective
            dist_rt.GradientBuckets(
                self.params,
                float(spread.get("bucket_mb", dist_rt.DEFAULT_BUCKET_MB)),
                overlap=self.overlap_comm,
            )
            if runtime.world_size > 1
            else None
        )
        # the no-gradient pass of a loss that needs its global batch sums (``batch_sums.py``)
        self.sum_chunker = InferenceChunker(2**31, 2**31, runtime.device)
        self.check_statistics()

    def _controller(self, training: dict, first: Member) -> MicroBatchController:
        """The batch-size controller: splits every batch on out-of-memory errors."""
        ctrl = training.get("batch_controller", {})
        spec = training["training_data"]["batch_size"]
        grow = bool(ctrl.get("grow", False)) and isinstance(spec, str) and spec.startswith("auto")
        # growing stops at a batch holding a whole system (per rank)
        most = max(
            -(-n // (b * self.rt.world_size))
            for n, b in zip(first.sampler.nframes, first.sampler.batch_sizes)
        )
        return MicroBatchController(
            retry_interval=int(ctrl.get("retry_interval", 200)), grow=grow, max_scale=most,
            micro_batches=ctrl.get("micro_batches"),
        )  # fmt: skip

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first member's optimiser (a single run's)."""
        return self.members[0].optimizer

    # ----------------------------------------------------------------- state
    def load_state_dicts(self, states: list[dict]) -> None:
        """Continue every member from its checkpoint (all of one step)."""
        steps = {m.load_state_dict(s) for m, s in zip(self.members, states, strict=True)}
        if len(steps) != 1:
            raise MDTrainError(f"committee checkpoints of different steps {sorted(steps)}")
        self.step = steps.pop()
        self.check_statistics()

    def check_statistics(self) -> None:
        """The shared environment needs every member's davg/dstd equal (one model: nothing to
        compare, and a combined model has no single descriptor)."""
        if len(self.members) > 1 and not stats_shared([m.model for m in self.members]):
            raise MDTrainError("committee members have different davg/dstd statistics")

    # ----------------------------------------------------------------- one step
    def _batch(self, system: System, frames: np.ndarray) -> Batch:
        rcut, sel, layout = self.lists
        return make_batch(
            system, frames, rcut, sel, self.rt.device, self.nlist_cache, layout, self.param_spec
        )

    def _forward(self, group: list[int], inputs: tuple) -> list[dict[str, torch.Tensor]]:
        """The group's members' predictions on one batch: a member alone, or the whole
        committee in one forward."""
        if len(group) == 1:
            return [self.members[group[0]].model(*inputs)]
        return self.model(*inputs)

    def _drawn(self, group: list[int], draws: list) -> tuple[int, np.ndarray]:
        index, frames = draws[group[0]]
        others = group[1:]  # a member alone drew its own batch: nothing to compare
        if any(draws[k][0] != index or not np.array_equal(draws[k][1], frames) for k in others):
            raise MDTrainError(
                "committee members drew different batches in shared sampling: their "
                "checkpoints are not of one committee run"
            )
        return index, frames

    def train_step(self, lr: float) -> list[dict[str, float]]:
        """One optimisation step of every member on this rank's share of the global batch;
        their metrics in member order."""
        growth = self.controller.suggest_growth()
        draws = [m.sampler.next_batch(growth) for m in self.members]
        if self.prefetch is not None and not self.prefetch.lists_complete(self.train_systems):
            depth = min(self.prefetch_depth, self.numb_steps - self.step - 1)
            samplers = [self.members[group[0]].sampler for group in self.groups]
            current = [draws[group[0]] for group in self.groups]
            self.prefetch.plan(self.lookahead.batches(samplers, current, depth, growth))
        for member in self.members:
            for group in member.optimizer.param_groups:
                group["lr"] = lr
        metrics: list = [None] * len(self.members)
        for i, group in enumerate(self.groups):
            last = i == len(self.groups) - 1
            results = self._step_group(group, *self._drawn(group, draws), lr, last)
            for k, result in zip(group, results, strict=True):
                metrics[k] = result
        buckets = self.grad_buckets
        if buckets is not None and self.overlap_comm:
            buckets.finish(self.rt.world_size)  # launched during (and after) the last backward
        elif buckets is not None:
            buckets.all_reduce(self.rt.world_size)
        self.apply_gradients()
        return metrics

    def _step_group(
        self, group: list[int], index: int, frames: np.ndarray, lr: float, last: bool
    ) -> list[dict[str, float]]:
        """The gradients of one group's members on its batch (``last``: the step's last
        group, whose last backward launches the gradient all-reduces when overlapping).

        Each micro-batch is read and assembled inside the attempt, so that an allocation
        failure there, like one in the model, is retried with smaller micro-batches."""
        system = self.train_systems[index]

        def attempt(slices: list[slice]) -> list[dict[str, float]]:
            parts: list[list] = [[] for _ in group]
            for j, (part, weight) in enumerate(zip(slices, frame_weights(slices, len(frames)))):
                micro = self._batch(system, frames[part])
                maybe_simulate_oom(micro.nframes * micro.natoms, self.rt.rank)
                total = None
                for i, pred in enumerate(self._forward(group, micro.inputs())):
                    loss_of = self.members[group[i]].loss
                    loss, metrics = loss_of(pred, micro.labels, micro.natoms, lr, weight=weight)
                    total = loss if total is None else total + loss
                    parts[i].append((metrics, weight))
                with self._communicating(last=last and j == len(slices) - 1):
                    # each member's parameters get their own loss's gradient
                    (total if self.scaler is None else self.scaler.scaled(total)).backward()
                del total, loss, pred
            return [merge_metrics(p) for p in parts]

        def zero_grad() -> None:
            for k in group:
                self.members[k].optimizer.zero_grad(set_to_none=True)

        launch_rest = self.grad_buckets.launch_rest if self.overlap_comm and last else None
        losses = [self.members[k].loss for k in group]
        batch_of = lambda f: self._batch(system, f)  # noqa: E731
        forward = lambda inputs: self._forward(group, inputs)  # noqa: E731
        with step_sums(losses, forward, batch_of, frames, system.natoms, system.path,
                       self.sum_chunker):  # fmt: skip
            return self.controller.run_step(
                attempt, len(frames), system.natoms, system.path, dist_rt.any_rank,
                zero_grad=zero_grad, before_vote=launch_rest,
            )  # fmt: skip

    def apply_gradients(self) -> None:
        """The optimiser steps on the (averaged) gradients, each member's clipped to
        ``training.gradient_max_norm`` first when it is set; with float16 products, the
        gradients unscaled first and the whole update skipped on every rank when one of
        them is not finite."""
        if self.scaler is not None and not self.scaler.unscale(self.params, dist_rt.any_rank):
            return
        if self.max_norm:
            for member in self.members:  # each its own gradient
                torch.nn.utils.clip_grad_norm_(member.params, float(self.max_norm))
        self.adam.step()
        for member in self.members:
            member.extras.after_update()  # the weight average, when on

    def _communicating(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a backward: the step's last one (its gradients are then complete) launches
        the gradient all-reduces as the buckets fill, when overlapping is on."""
        if last and self.overlap_comm:
            return self.grad_buckets.launching()
        return contextlib.nullcontext()

    # ----------------------------------------------------------------- validation
    def validate(self, lr: float) -> list[dict[str, float]] | None:
        """Every member's errors on its ``numb_btch`` validation batches, pooled as sums over
        every rank (a group's batch evaluated once, by one forward). A batch that runs out
        of memory is evaluated in chunks of frames (the same sums)."""
        first = self.members[0]
        if first.valid_sampler is None:
            return None
        extra = self.loss.loss_metric_keys()
        accs = [ErrorAccumulator(extra=extra) for _ in self.members]
        self.model.eval()
        try:
            for _ in range(first.numb_valid):
                draws = [m.valid_sampler.next_batch() for m in self.members]
                for group in self.groups:
                    index, frames = draws[group[0]]
                    system = self.valid_systems[index]
                    whole = len(frames) * system.natoms
                    chunker = InferenceChunker(whole, whole, self.rt.device)
                    for parts in chunker.run_all(
                        lambda start, stop, g=group, s=system, f=frames: self._errors(
                            g, s, f[start:stop], lr, len(f)
                        ),
                        len(frames), system.natoms, system.path,
                    ):  # fmt: skip
                        for k, part in zip(group, parts, strict=True):
                            accs[k].merge(part)
        finally:
            self.model.train()
        sums = dist_rt.all_reduce_sum(torch.stack([acc.to_tensor() for acc in accs]))
        return [ErrorAccumulator.from_tensor(s, extra).rmse() for s in sums]

    def _errors(
        self, group: list[int], system: System, frames: np.ndarray, lr: float, whole: int
    ) -> list[ErrorAccumulator]:
        """The validation errors of the group's members on some frames of one system, a chunk
        of a batch of ``whole`` frames. The loss counted per frame is the square of the loss's
        ``rmse`` metric at the chunk's weight (its mean loss, or for a sum over frames the
        chunk's share of the batch's sum): chunks then add up to the whole batch."""
        batch = self._batch(system, frames)
        out = []
        for k, pred in zip(group, self._forward(group, batch.inputs()), strict=True):
            loss_of = self.members[k].loss
            _, metrics = loss_of(
                {key: v.detach() for key, v in pred.items()},
                batch.labels,
                batch.natoms,
                lr,
                weight=len(frames) / whole,
            )
            acc = ErrorAccumulator(extra=loss_of.loss_metric_keys())
            acc.add(pred, batch.labels, batch.natoms, loss=metrics["rmse"] ** 2, metrics=metrics)
            out.append(acc)
        return out


def seed_everything(seed: int) -> None:
    """Model initialisation must be identical on every rank (parameters are also broadcast)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
