"""One model of a training run: what a single run has of its own, and each member of a
committee has once per member.

A `Member` owns its model, optimiser, learning-rate schedule, loss, samplers, weight average,
checkpoints and lcurve.out (all in its folder: the run's, or ``member-k/``), and writes and
reads its checkpoint. It takes no step: the trainer (``mdtrain.train.loop.Trainer``) steps
every member together, and owns what they share (the step counter, the batches, the
batch-size controller, the gradient buckets).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from mdtrain import distributed as dist_rt
from mdtrain.batching import Batch
from mdtrain.data import System
from mdtrain.distributed import Runtime
from mdtrain.train.batch_controller import merge_states
from mdtrain.train.checkpoint import CheckpointManager, load_rng_state, rng_state_dict
from mdtrain.train.epochs import run_length
from mdtrain.train.extras import RunExtras, refuse_averaged
from mdtrain.train.lcurve import LcurveWriter
from mdtrain.train.loss import make_loss
from mdtrain.train.lr import make_schedule
from mdtrain.train.optimizer import load_optimizer_state, reserve_state
from mdtrain.train.sampler import TrainingSampler, make_sampler
from mdtrain.train.tensorboard import tensorboard_writer
from mdtrain.train.zero import build_optimizer

if TYPE_CHECKING:
    from mdtrain.train.loop import Trainer

log = logging.getLogger("mdtrain")
CHECKPOINT_FORMAT = "mdtrain-checkpoint"


class Member:
    """One model's own part of a run (see the module docstring). ``config`` is the input a
    single run of this model would have; ``extra``: entries its every checkpoint gets."""

    def __init__(
        self, trainer: Trainer, config: dict, model: torch.nn.Module, out_dir: str, extra: dict
    ) -> None:
        self.trainer, self.config, self.model, self.out_dir = trainer, config, model, out_dir
        self.rt: Runtime = trainer.rt
        self.train_systems, self.valid_systems = trainer.train_systems, trainer.valid_systems
        training, lr_cfg = config["training"], config["learning_rate"]
        seed = int(training.get("seed") or 0)
        self.sampler = make_sampler(
            self.train_systems, training["training_data"], seed, self.rt, "training_data"
        )
        self.valid_sampler: TrainingSampler | None = None
        self.numb_valid = 0
        if self.valid_systems:
            vcfg = training["validation_data"]
            self.valid_sampler = make_sampler(
                self.valid_systems, vcfg, seed + 1, self.rt, "validation_data"
            )
            self.numb_valid = int(vcfg.get("numb_btch", 1))
        self.numb_steps = run_length(training, self.sampler)
        self.lr = make_schedule(lr_cfg, self.numb_steps)
        self.loss = make_loss(config["loss"], lr_cfg["start_lr"], model, self.rt.world_size)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.optimizer = build_optimizer(  # sharded over ranks with training.zero_stage 1
            config.get("optimizer"), named, lr_cfg["start_lr"],
            int(training.get("zero_stage", 0)), self.rt.rank, self.rt.world_size,
        )  # fmt: skip
        reserve_state(self.optimizer)  # no allocation inside a step's parameter update
        self.checkpoint_extra = dict(extra)
        self.ckpt = CheckpointManager(
            out_dir, training["save_ckpt"], int(training["max_ckpt_keep"])
        )
        self.lcurve_path = os.path.join(out_dir, training["disp_file"])
        self.extras = RunExtras(self)  # EMA, full validation, bias refit (off by default)

    @property
    def step(self) -> int:
        """The run's step (every member takes each step)."""
        return self.trainer.step

    def _batch(self, system: System, frames: np.ndarray) -> Batch:
        return self.trainer._batch(system, frames)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        scaler = self.trainer.scaler
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
            "controller_state": self.trainer.controller.state_dict(),
            "mixed_precision": self.trainer.precision,
            "rng_state": rng_state_dict(),
            "config": self.config,
            **({"loss_scale": scaler.state_dict()} if scaler else {}),
            **self.extras.state_dict(),
            **self.checkpoint_extra,
        }

    def load_state_dict(self, state: dict) -> int:
        """Continue exactly: everything that changes the next step is restored (the shared
        controller's and loss scale's too); returns the checkpoint's step."""
        refuse_averaged(state)
        self.model.load_state_dict(state["model_state"])
        load_optimizer_state(self.optimizer, state["optimizer_state"])
        self.sampler.load_state_dict(state["sampler_state"])
        if self.valid_sampler is not None and state.get("valid_sampler_state"):
            self.valid_sampler.load_state_dict(state["valid_sampler_state"])
        self.trainer.controller.load_state_dict(state["controller_state"])
        load_rng_state(state["rng_state"])
        scaler = self.trainer.scaler
        if scaler is not None and state.get("loss_scale"):
            scaler.load_state_dict(state["loss_scale"])
        self.extras.load_state_dict(state)
        return int(state["step"])

    # ----------------------------------------------------------------- checkpoints
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
        dist_rt.raise_together(error, f"rank 0 could not write the checkpoint of step {self.step}")
        if path is not None:
            log.info("saved checkpoint %s", path)
        return path

    def gather_optimizer(self) -> None:
        """A sharded optimiser's state gathered on rank 0 (a collective, on every rank)."""
        consolidate = getattr(self.optimizer, "consolidate", None)
        if consolidate is not None:
            consolidate()

    def _controller_state(self) -> dict:
        """Every rank's split per size in one state (ranks learn their own sizes): a
        collective, on every rank."""
        state = self.trainer.controller.state_dict()
        if self.rt.world_size == 1 or not torch.distributed.is_initialized():
            return state
        states: list = [None] * self.rt.world_size
        torch.distributed.all_gather_object(states, state)
        return merge_states(states)

    # ----------------------------------------------------------------- outputs
    def open_lcurve(self, keys: list[str], append: bool) -> LcurveWriter | None:
        """This member's lcurve.out writer (rank 0 only), continuing at the run's step."""
        if not self.rt.is_main:
            return None
        return LcurveWriter(
            self.lcurve_path,
            keys,
            self.valid_sampler is not None,
            append=append,
            resume_step=self.step if append else None,
            mirror=tensorboard_writer(self.config["training"], self.out_dir),
        )
