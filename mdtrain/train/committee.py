"""Committee training: N members trained in one process (or one job of ranks), each exactly
the model a single run would give, with the data work done once.

Member ``k`` is a single run's ``Trainer`` of its own (model, Adam, learning-rate schedule,
samplers, lcurve.out and checkpoints in ``member-k/``), built from the member's input
(`member_config`). Two ways of sampling:

- ``"shared"`` (fresh models): member k's model seeds are the input's + k and its training
  seed the input's, so every member draws the same frames in the same order. The committee
  then takes each step together: one batch (frames, neighbour lists), one forward of the
  committee model (the accelerated one computes the environment matrix once for all members
  and batches their fitting nets), the sum of the members' losses and one backward. The
  members share no parameters, so each gets exactly its own gradient; each clips it
  (``training.gradient_max_norm``), and the members' Adam optimisers take their steps in one
  fused call (``step_together``). One batch-size controller splits the shared batch on
  out-of-memory errors, and one set of gradient buckets averages every member's gradients
  over the ranks.
- ``"per-member"`` (``--init-model``/``--finetune``: every member starts from the same
  weights): member k's training seed is the input's + k, so the members draw different
  frames; each member's trainer takes its own step in turn (with its own controller and
  buckets), sharing the systems and the neighbour-list cache.

Statistics (davg/dstd, energy bias) depend on the data only: the caller computes them once
and copies them into every member (``Committee.share_statistics``).
"""

from __future__ import annotations

import contextlib
import copy
import logging

import numpy as np
import torch

from mdtrain import distributed as dist_rt
from mdtrain.batching import Batch, NeighborListCache, make_batch
from mdtrain.data import System
from mdtrain.distributed import Runtime
from mdtrain.errors import MDTrainError
from mdtrain.memory import InferenceChunker, maybe_simulate_oom
from mdtrain.model.committee import Committee, member_model_config
from mdtrain.train.batch_controller import frame_weights
from mdtrain.train.display import Display
from mdtrain.train.lcurve import LcurveWriter
from mdtrain.train.loop import Trainer
from mdtrain.train.loss import ErrorAccumulator, merge_metrics
from mdtrain.train.optimizer import step_together
from mdtrain.train.precision import committee_problem, mixed_precision
from mdtrain.train.resume import member_dir
from mdtrain.train.training_loop import TrainingLoop

log = logging.getLogger("mdtrain")

SHARED, PER_MEMBER = "shared", "per-member"


def ensemble_size(option: int | None, training: dict) -> int:
    """``--ensemble`` (wins) or ``training.ensemble``; 1 is a single run."""
    value = option if option is not None else training.get("ensemble", 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MDTrainError(f"training.ensemble / --ensemble must be an integer >= 1, got {value!r}")
    return int(value)


def member_config(config: dict, k: int, sampling: str) -> dict:
    """The input a single run would need to train member ``k``: model seeds + k ("shared"),
    or the training seed + k ("per-member"); ``training.ensemble`` 1."""
    config = copy.deepcopy(config)
    if sampling == SHARED:
        config["model"] = member_model_config(config["model"], k)
    else:
        config["training"]["seed"] = int(config["training"]["seed"]) + k
    config["training"]["ensemble"] = 1
    return config


class CommitteeTrainer(TrainingLoop):
    """Trains the members of ``committee`` together (see the module docstring); ``run()`` as
    a ``Trainer``'s."""

    def __init__(
        self,
        config: dict,
        committee: Committee,
        member_configs: list[dict],
        train_systems: list[System],
        valid_systems: list[System],
        runtime: Runtime,
        out_dir: str,
        sampling: str,
        nlist_cache: NeighborListCache | None = None,
    ) -> None:
        if sampling not in (SHARED, PER_MEMBER):
            raise ValueError(f"unknown committee sampling {sampling!r}")
        self.config, self.model, self.rt, self.out_dir = config, committee, runtime, out_dir
        self.shared = sampling == SHARED
        self.train_systems, self.valid_systems = train_systems, valid_systems
        self.nlist_cache = NeighborListCache() if nlist_cache is None else nlist_cache
        self.members: list[Trainer] = []
        size = len(member_configs)
        for k, (cfg, model) in enumerate(zip(member_configs, committee.members, strict=True)):
            member = Trainer(
                cfg, model, train_systems, valid_systems, runtime, member_dir(out_dir, k),
                nlist_cache=self.nlist_cache, gradient_buckets=not self.shared,
            )  # fmt: skip
            member.checkpoint_extra = {
                "committee": {"size": size, "member": k, "sampling": sampling}
            }
            self.members.append(member)
        first = self.members[0]
        self.numb_steps, self.disp_freq, self.save_freq = (
            first.numb_steps, first.disp_freq, first.save_freq,
        )  # fmt: skip
        self.loss, self.lr, self.precision = first.loss, first.lr, first.precision
        if problem := committee_problem(config["training"].get("mixed_precision"), size):
            raise MDTrainError(problem)  # --ensemble given on the command line
        self.descriptor, self.param_spec = first.descriptor, first.param_spec
        self.lists = first.lists
        self.step = 0
        self.controller = first.controller
        self.grad_buckets = None
        self.overlap_comm = False
        if self.shared:  # one controller and one set of buckets for the joint step
            for member in self.members[1:]:
                member.controller = self.controller
            self.overlap_comm = first.overlap_comm
            if runtime.world_size > 1:
                spread = config["training"].get("distributed", {})
                self.grad_buckets = dist_rt.GradientBuckets(
                    [p for m in self.members for p in m.params],
                    float(spread.get("bucket_mb", dist_rt.DEFAULT_BUCKET_MB)),
                    overlap=self.overlap_comm,
                )

    # ----------------------------------------------------------------- state
    def load_state_dicts(self, states: list[dict]) -> None:
        """Continue every member from its checkpoint (all of one step)."""
        for member, state in zip(self.members, states, strict=True):
            member.load_state_dict(state)
        steps = sorted({m.step for m in self.members})
        if len(steps) != 1:
            raise MDTrainError(f"committee checkpoints of different steps {steps}")
        self.step = steps[0]
        self.check_statistics()

    def check_statistics(self) -> None:
        """The shared environment needs every member's davg/dstd equal."""
        if not self.model.stats_shared():
            raise MDTrainError("committee members have different davg/dstd statistics")

    def precision_applied(self) -> contextlib.AbstractContextManager:
        return mixed_precision(
            self.precision, self.members[0].model, self.rt.device, self.rt.is_main
        )

    # ----------------------------------------------------------------- one step
    def _batch(self, system: System, frames: np.ndarray) -> Batch:
        rcut, sel, layout = self.lists
        return make_batch(
            system, frames, rcut, sel, self.rt.device, self.nlist_cache, layout, self.param_spec
        )

    def train_step(self, lr: float) -> list[dict[str, float]]:
        """One step of every member; their metrics in member order."""
        if not self.shared:
            return [member.train_step(lr) for member in self.members]
        growth = self.controller.suggest_growth()
        draws = [member.sampler.next_batch(growth) for member in self.members]
        index, frames = draws[0]
        if any(i != index or not np.array_equal(f, frames) for i, f in draws[1:]):
            raise MDTrainError(
                "committee members drew different batches in shared sampling: their "
                "checkpoints are not of one committee run"
            )
        system = self.train_systems[index]
        for member in self.members:
            member.set_lr(lr)

        def attempt(slices: list[slice]) -> list[dict[str, float]]:
            parts: list[list] = [[] for _ in self.members]
            for k, (part, weight) in enumerate(zip(slices, frame_weights(slices, len(frames)))):
                micro = self._batch(system, frames[part])
                maybe_simulate_oom(micro.nframes * micro.natoms, self.rt.rank)
                total = None
                for j, pred in enumerate(self.model(*micro.inputs())):
                    loss, metrics = self.loss(pred, micro.labels, micro.natoms, lr, weight=weight)
                    total = loss if total is None else total + loss
                    parts[j].append((metrics, weight))
                with self._communicating(last=k == len(slices) - 1):
                    total.backward()  # each member's parameters get their own loss's gradient
                del total, loss, pred
            return [merge_metrics(p) for p in parts]

        def zero_grad() -> None:
            for member in self.members:
                member.optimizer.zero_grad(set_to_none=True)

        buckets = self.grad_buckets
        metrics = self.controller.run_step(
            attempt, len(frames), system.natoms, system.path, dist_rt.any_rank,
            zero_grad=zero_grad, before_vote=buckets.launch_rest if self.overlap_comm else None,
        )  # fmt: skip
        if buckets is not None and self.overlap_comm:
            buckets.finish(self.rt.world_size)
        elif buckets is not None:
            buckets.all_reduce(self.rt.world_size)
        for member in self.members:
            member.clip_gradients()  # each its own gradient
        step_together([member.optimizer for member in self.members])
        for member in self.members:
            member.extras.after_update()  # the weight average, when on
        return metrics

    def _communicating(self, last: bool) -> contextlib.AbstractContextManager:
        if last and self.overlap_comm:
            return self.grad_buckets.launching()
        return contextlib.nullcontext()

    def validate(self, lr: float) -> list[dict[str, float]] | None:
        """Every member's validation errors (``Trainer.validate``); with shared sampling the
        members' validation batches are the same, evaluated once by the committee."""
        if not self.shared:
            errors = [member.validate(lr) for member in self.members]
            return None if errors[0] is None else errors
        first = self.members[0]
        if first.valid_sampler is None:
            return None
        extra = self.loss.loss_metric_keys()
        accs = [ErrorAccumulator(extra=extra) for _ in self.members]
        self.model.eval()
        try:
            for _ in range(first.numb_valid):
                index, frames = [m.valid_sampler.next_batch() for m in self.members][0]
                system = self.valid_systems[index]
                whole = len(frames) * system.natoms
                chunker = InferenceChunker(whole, whole, self.rt.device)
                for parts in chunker.run_all(
                    lambda start, stop, s=system, f=frames: self._errors(s, f[start:stop], lr),
                    len(frames), system.natoms, system.path,
                ):  # fmt: skip
                    for acc, part in zip(accs, parts, strict=True):
                        acc.merge(part)
        finally:
            self.model.train()
        sums = dist_rt.all_reduce_sum(torch.stack([acc.to_tensor() for acc in accs]))
        return [ErrorAccumulator.from_tensor(s, extra).rmse() for s in sums]

    def _errors(self, system: System, frames: np.ndarray, lr: float) -> list[ErrorAccumulator]:
        batch = self._batch(system, frames)
        out = []
        for pred in self.model(*batch.inputs()):
            loss, metrics = self.loss(
                {k: v.detach() for k, v in pred.items()}, batch.labels, batch.natoms, lr
            )
            acc = ErrorAccumulator(extra=self.loss.loss_metric_keys())
            acc.add(pred, batch.labels, batch.natoms, loss=loss, metrics=metrics)
            out.append(acc)
        return out

    def validate_fully(self) -> None:
        """Each member's full validation (``validating``), when due."""
        for member in self.members:
            member.step = self.step
            member.validate_fully()

    def finish(self, first_step: int) -> str | None:
        """Each member's bias refit (``change_bias_after_training``); member 0's path."""
        paths = []
        for member in self.members:
            member.step = self.step
            paths.append(member.finish(first_step))
        return paths[0]

    # ----------------------------------------------------------------- outputs
    def save(self) -> str | None:
        """Every member's checkpoint of this step (member 0's path returned)."""
        paths = []
        for member in self.members:
            member.step = self.step
            paths.append(member.save())
        return paths[0]

    def _open_lcurves(self, keys: list[str], append: bool) -> list[LcurveWriter]:
        writers: list[LcurveWriter] = []
        for member in self.members:
            member.step = self.step
            writers += member._open_lcurves(keys, append)
        return writers

    def _report(
        self, writers: list[LcurveWriter], display: Display, lr: float, metrics, valid
    ) -> None:
        for k, writer in enumerate(writers):
            writer.write(self.step, lr, metrics[k], None if valid is None else valid[k])
        log.info(display.members_line(self.step, lr, metrics, valid))
