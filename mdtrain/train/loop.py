"""The training loop: one step = sample a batch, forward, loss, backward (micro-batched on
OOM), average gradients across ranks, Adam update; plus display, validation, checkpoints and
preemption. Every rank takes every decision (retry, stop) together."""

from __future__ import annotations

import contextlib
import logging
import os

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
from mdtrain.neighbors.layout import layout_of
from mdtrain.train.batch_controller import MicroBatchController, frame_weights, merge_states
from mdtrain.train.checkpoint import CheckpointManager, load_rng_state, rng_state_dict
from mdtrain.train.display import Display
from mdtrain.train.epochs import run_length
from mdtrain.train.extras import RunExtras, refuse_averaged
from mdtrain.train.lcurve import LcurveWriter
from mdtrain.train.loss import ErrorAccumulator, check_labels, make_loss, merge_metrics
from mdtrain.train.loss_scale import LossScaler
from mdtrain.train.lr import make_schedule
from mdtrain.train.optimizer import load_optimizer_state, reserve_state
from mdtrain.train.precision import check_networks, mixed_precision, mode_of
from mdtrain.train.sampler import TrainingSampler, batch_sizes, batches_per_epoch, system_probs
from mdtrain.train.tensorboard import tensorboard_writer
from mdtrain.train.training_loop import TrainingLoop
from mdtrain.train.zero import build_optimizer

log = logging.getLogger("mdtrain")
CHECKPOINT_FORMAT = "mdtrain-checkpoint"


def make_sampler(
    systems: list[System], data_cfg: dict, seed: int, rt: Runtime | int, section: str
) -> TrainingSampler:
    """The sampler of one data section; ``rt`` a runtime or a world size (for checks only)."""
    rank, world = (0, rt) if isinstance(rt, int) else (rt.rank, rt.world_size)
    natoms = [s.natoms for s in systems]
    nframes = [s.nframes for s in systems]
    sources = [s.source for s in systems]  # a mixed-type system gives several
    spec = data_cfg["batch_size"]
    sizes = batch_sizes(spec, natoms, f"training.{section}.batch_size", sources, nframes)
    nbatch = batches_per_epoch(nframes, sizes, world)
    probs = system_probs(
        nbatch, data_cfg.get("sys_probs"), data_cfg.get("auto_prob", "prob_sys_size"),
        f"training.{section}", sources,
    )  # fmt: skip
    return TrainingSampler(nframes, sizes, probs, seed, rank, world)


class Trainer(TrainingLoop):
    """Owns the optimiser, samplers and writers of one run; ``run()`` trains to numb_steps.

    ``nlist_cache``: a neighbour-list cache to use (a committee's members share one);
    ``gradient_buckets`` False: this trainer does not average its gradients over ranks (a
    committee that steps its members together averages all of them at once)."""

    def __init__(
        self,
        config: dict,
        model: torch.nn.Module,
        train_systems: list[System],
        valid_systems: list[System],
        runtime: Runtime,
        out_dir: str = ".",
        nlist_cache: NeighborListCache | None = None,
        gradient_buckets: bool = True,
    ) -> None:
        self.config = config
        self.model = model
        self.rt = runtime
        self.out_dir = out_dir
        training, lr_cfg = config["training"], config["learning_rate"]
        self.train_systems, self.valid_systems = train_systems, valid_systems
        seed = int(training.get("seed") or 0)
        self.sampler = make_sampler(
            train_systems, training["training_data"], seed, runtime, "training_data"
        )
        self.valid_sampler = None
        self.numb_valid = 0
        if valid_systems:
            vcfg = training["validation_data"]
            self.valid_sampler = make_sampler(
                valid_systems, vcfg, seed + 1, runtime, "validation_data"
            )
            self.numb_valid = int(vcfg.get("numb_btch", 1))
        self.numb_steps = run_length(training, self.sampler)
        self.lr = make_schedule(lr_cfg, self.numb_steps)
        self.loss = make_loss(config["loss"], lr_cfg["start_lr"], model)
        outputs = output_labels(config["model"])
        check_labels(config["loss"], [*train_systems, *valid_systems], outputs)
        for system in [*train_systems, *valid_systems]:  # before any step: one line if not
            check_params(system, ParamSpec.of(config["model"]))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.optimizer = build_optimizer(  # sharded over ranks with training.zero_stage 1
            config.get("optimizer"), named, lr_cfg["start_lr"],
            int(training.get("zero_stage", 0)), runtime.rank, runtime.world_size,
        )  # fmt: skip
        reserve_state(self.optimizer)  # no allocation inside a step's parameter update
        spread = training.get("distributed", {})
        self.overlap_comm = runtime.world_size > 1 and bool(spread.get("overlap_comm", True))
        self.grad_buckets = (  # likewise for averaging the gradients over ranks
            dist_rt.GradientBuckets(
                self.params,
                float(spread.get("bucket_mb", dist_rt.DEFAULT_BUCKET_MB)),
                overlap=self.overlap_comm,
            )
            if runtime.world_size > 1 and gradient_buckets
            else None
        )
        ctrl = training.get("batch_controller", {})
        spec = training["training_data"]["batch_size"]
        grow = bool(ctrl.get("grow", False)) and isinstance(spec, str) and spec.startswith("auto")
        # growing stops at a batch holding a whole system (per rank)
        most = max(
            -(-n // (b * runtime.world_size))
            for n, b in zip(self.sampler.nframes, self.sampler.batch_sizes)
        )
        self.controller = MicroBatchController(
            retry_interval=int(ctrl.get("retry_interval", 200)), grow=grow, max_scale=most,
            micro_batches=ctrl.get("micro_batches"),
        )  # fmt: skip
        self.descriptor = config["model"].get("descriptor")  # none: linear_ener, pairtab
        self.param_spec = ParamSpec.of(config["model"])
        # the model's neighbour lists: cut-off, sel (per type, or [total] for a type-mixed
        # list; a hybrid's largest) and layout (``mdtrain.neighbors.layout``), chosen once
        self.lists = (float(model.rcut), list(model.sel), layout_of(model))
        # frames come back many times: search once
        self.nlist_cache = NeighborListCache() if nlist_cache is None else nlist_cache
        self.disp_freq = int(training["disp_freq"])
        self.save_freq = int(training["save_freq"])
        self.max_norm = training.get("gradient_max_norm")
        self.precision = mode_of(training.get("mixed_precision"))  # None, tf32, bf16, fp16
        check_networks(
            training.get("mixed_precision"), model.get_model_config(), "training.mixed_precision"
        )
        self.scaler = LossScaler() if self.precision == "fp16" else None  # float16 underflows
        self.step = 0
        self.checkpoint_extra: dict = {}  # entries every checkpoint gets (a committee's)
        self.ckpt = CheckpointManager(
            out_dir, training["save_ckpt"], int(training["max_ckpt_keep"])
        )
        self.lcurve_path = os.path.join(out_dir, training["disp_file"])
        self.extras = RunExtras(self)  # EMA, full validation, bias refit (off by default)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "version": 1,
            "step": self.step,
            "model_config": self.model.get_model_config(),
            "model_state": self.model.state_dict(),
            "optimizer_state": self.optimizer.state_dict(),
            "sampler_state": self.sampler.state_dict(),
            "valid_sampler_state": None
            if self.valid_sampler is None
            else self.valid_sampler.state_dict(),
            "controller_state": self.controller.state_dict(),
            "mixed_precision": self.precision,
            "rng_state": rng_state_dict(),
            "config": self.config,
            **({"loss_scale": self.scaler.state_dict()} if self.scaler else {}),
            **self.extras.state_dict(),
            **self.checkpoint_extra,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue a run exactly: everything that changes the next step is restored."""
        refuse_averaged(state)
        self.model.load_state_dict(state["model_state"])
        load_optimizer_state(self.optimizer, state["optimizer_state"])
        self.sampler.load_state_dict(state["sampler_state"])
        if self.valid_sampler is not None and state.get("valid_sampler_state"):
            self.valid_sampler.load_state_dict(state["valid_sampler_state"])
        self.controller.load_state_dict(state["controller_state"])
        load_rng_state(state["rng_state"])
        self.step = int(state["step"])
        if self.scaler is not None and state.get("loss_scale"):
            self.scaler.load_state_dict(state["loss_scale"])
        self.extras.load_state_dict(state)

    def precision_applied(self) -> contextlib.AbstractContextManager:
        """The mixed-precision setting in force inside the block (``run`` trains in it)."""
        return mixed_precision(self.precision, self.model, self.rt.device, self.rt.is_main)

    # ----------------------------------------------------------------- one step
    def _batch(self, system: System, frames: np.ndarray) -> Batch:
        rcut, sel, layout = self.lists
        return make_batch(
            system, frames, rcut, sel, self.rt.device, self.nlist_cache, layout, self.param_spec
        )

    def train_step(self, lr: float) -> dict[str, float]:
        """One optimisation step on this rank's share of the global batch; returns its metrics.

        Each micro-batch is read and assembled inside the attempt, so that an allocation
        failure there, like one in the model, is retried with smaller micro-batches."""
        index, frames = self.sampler.next_batch(self.controller.suggest_growth())
        system = self.train_systems[index]
        self.set_lr(lr)

        def attempt(slices: list[slice]) -> dict[str, float]:
            parts = []
            for k, (part, weight) in enumerate(zip(slices, frame_weights(slices, len(frames)))):
                micro = self._batch(system, frames[part])
                maybe_simulate_oom(micro.nframes * micro.natoms, self.rt.rank)
                pred = self.model(*micro.inputs())
                loss, metrics = self.loss(pred, micro.labels, micro.natoms, lr, weight=weight)
                with self._communicating(last=k == len(slices) - 1):
                    (loss if self.scaler is None else self.scaler.scaled(loss)).backward()
                del pred, loss
                parts.append((metrics, weight))
            return merge_metrics(parts)

        buckets = self.grad_buckets
        metrics = self.controller.run_step(
            attempt, len(frames), system.natoms, system.path, dist_rt.any_rank,
            zero_grad=lambda: self.optimizer.zero_grad(set_to_none=True),
            before_vote=buckets.launch_rest if self.overlap_comm else None,
        )  # fmt: skip
        if buckets is not None and self.overlap_comm:
            buckets.finish(self.rt.world_size)  # launched during (and after) the last backward
        elif buckets is not None:
            buckets.all_reduce(self.rt.world_size)
        self.apply_gradients()
        return metrics

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def apply_gradients(self) -> None:
        """The optimiser step on the (averaged) gradients, clipped to
        ``training.gradient_max_norm`` first when it is set; with float16 products, the
        gradients unscaled first and the whole update skipped on every rank when one of
        them is not finite."""
        if self.scaler is not None and not self.scaler.unscale(self.params, dist_rt.any_rank):
            return
        self.clip_gradients()
        self.optimizer.step()
        self.extras.after_update()

    def clip_gradients(self) -> None:
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.params, float(self.max_norm))

    def _communicating(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a backward: the step's last one (its gradients are then complete) launches
        the gradient all-reduces as the buckets fill, when overlapping is on."""
        if last and self.overlap_comm:
            return self.grad_buckets.launching()
        return contextlib.nullcontext()

    def validate(self, lr: float) -> dict[str, float] | None:
        """Errors on ``numb_btch`` validation batches, pooled as sums over every rank. A batch
        that runs out of memory is evaluated in chunks of frames (the same sums)."""
        if self.valid_sampler is None:
            return None
        acc = ErrorAccumulator(extra=self.loss.loss_metric_keys())
        self.model.eval()
        try:
            for _ in range(self.numb_valid):
                index, frames = self.valid_sampler.next_batch()
                system = self.valid_systems[index]
                whole = len(frames) * system.natoms
                chunker = InferenceChunker(whole, whole, self.rt.device)
                for part in chunker.run_all(
                    lambda start, stop, s=system, f=frames: self._errors(s, f[start:stop], lr),
                    len(frames), system.natoms, system.path,
                ):  # fmt: skip
                    acc.merge(part)
        finally:
            self.model.train()
        total = ErrorAccumulator.from_tensor(
            dist_rt.all_reduce_sum(acc.to_tensor()), self.loss.loss_metric_keys()
        )
        return total.rmse()

    def _errors(self, system: System, frames: np.ndarray, lr: float) -> ErrorAccumulator:
        """The validation errors of some frames of one system."""
        batch = self._batch(system, frames)
        pred = self.model(*batch.inputs())
        loss, metrics = self.loss(
            {k: v.detach() for k, v in pred.items()}, batch.labels, batch.natoms, lr
        )
        acc = ErrorAccumulator(extra=self.loss.loss_metric_keys())
        acc.add(pred, batch.labels, batch.natoms, loss=loss, metrics=metrics)
        return acc

    # ----------------------------------------------------------------- the loop
    def save(self) -> str | None:
        """Rank 0 writes (ranks hold identical state, but for the splits per batch size, which
        are gathered first); every rank learns whether it worked, so a full disk stops all of
        them at this step instead of leaving the others waiting."""
        path, error = None, None
        controller_state = self._controller_state()
        self.gather_optimizer()
        if self.rt.is_main:
            try:
                state = self.state_dict()
                state["controller_state"] = controller_state
                path = self.ckpt.save(self.step, state)
                self.extras.save_average(state)
            except Exception as exc:  # noqa: BLE001 (re-raised below, after the vote)
                error = exc
        if dist_rt.any_rank(error is not None):
            if error is not None:
                raise error
            raise MDTrainError(f"rank 0 could not write the checkpoint of step {self.step}")
        if path is not None:
            log.info("saved checkpoint %s", path)
        return path

    def validate_fully(self) -> None:
        self.extras.validate_fully()

    def finish(self, first_step: int) -> str | None:
        return self.extras.finish(first_step)

    def gather_optimizer(self) -> None:
        """A sharded optimiser's state gathered on rank 0 (a collective, on every rank)."""
        consolidate = getattr(self.optimizer, "consolidate", None)
        if consolidate is not None:
            consolidate()

    def _controller_state(self) -> dict:
        """Every rank's split per size in one state (ranks learn their own sizes): a
        collective, on every rank."""
        state = self.controller.state_dict()
        if self.rt.world_size == 1 or not torch.distributed.is_initialized():
            return state
        states: list = [None] * self.rt.world_size
        torch.distributed.all_gather_object(states, state)
        return merge_states(states)

    def _open_lcurves(self, keys: list[str], append: bool) -> list[LcurveWriter]:
        if not self.rt.is_main:
            return []
        return [
            LcurveWriter(
                self.lcurve_path,
                keys,
                self.valid_sampler is not None,
                append=append,
                resume_step=self.step if append else None,
                mirror=tensorboard_writer(self.config["training"], self.out_dir),
            )
        ]

    def _report(
        self, writers: list[LcurveWriter], display: Display, lr: float, metrics, valid
    ) -> None:
        for writer in writers:
            writer.write(self.step, lr, metrics, valid)
        log.info(display.line(self.step, lr, metrics, valid))


def seed_everything(seed: int) -> None:
    """Model initialisation must be identical on every rank (parameters are also broadcast)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
