"""What a run's `Member` does besides its steps when the input asks for it: the weight average
(``training.enable_ema``, `mdtrain.train.ema`), full validation (``validating``,
`mdtrain.train.full_validation`) and the bias refit after the last step
(``training.change_bias_after_training``, `mdtrain.train.bias`). Each is off by default and
then costs nothing: the steps, checkpoints and lcurve.out of a run without them are unchanged.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from mdtrain import distributed as dist_rt
from mdtrain.errors import MDTrainError
from mdtrain.memory import InferenceChunker
from mdtrain.model.files import AVERAGED, STANDS_FOR
from mdtrain.train.bias import bias_text, refit_energy_bias
from mdtrain.train.checkpoint import CheckpointManager, save_checkpoint
from mdtrain.train.ema import EMA_KEY, WeightAverage, ema_prefix
from mdtrain.train.full_validation import FullValidator, frame_errors, start_step

if TYPE_CHECKING:
    from mdtrain.train.member import Member

log = logging.getLogger("mdtrain")

RECORDS = "full_validation"


def validator_metric(section: dict) -> str:
    return str(section.get("validation_metric", "E:MAE")).strip().lower()


def refuse_averaged(state: dict) -> None:
    """A checkpoint of averaged weights cannot be continued: it has no optimiser state."""
    if state.get(AVERAGED):
        raise MDTrainError(
            "--restart: the checkpoint holds averaged weights (training.enable_ema) and no "
            "optimiser state; continue from the regular checkpoint of that step"
        )


class RunExtras:
    """The optional parts of one member's run (see the module docstring)."""

    def __init__(self, member: Member) -> None:
        self.t = member
        training = member.config["training"]
        self.ema = None
        if training.get("enable_ema"):
            self.ema = WeightAverage(member.model, float(training.get("ema_decay", 0.999)))
            keep = training.get("ema_ckpt_keep") or int(training.get("max_ckpt_keep", 5))
            prefix = ema_prefix(training["save_ckpt"])
            self.ema_ckpt = CheckpointManager(member.out_dir, prefix, int(keep), index=False)
        self.section = member.config.get("validating") or {}
        self.flows: dict[str, FullValidator] | None = None  # built at the first use
        self.records: dict = {}
        self.restored = False
        self.change_bias = bool(training.get("change_bias_after_training"))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        state: dict = {}
        if self.ema is not None:
            state[EMA_KEY] = self.ema.state_dict()
        records = {k: v.state() for k, v in (self.flows or {}).items()} or self.records
        if records:
            state[RECORDS] = records
        return state

    def load_state_dict(self, state: dict) -> None:
        """After the trainer restored the model: the average (a checkpoint without one starts
        it from the restored weights, as DeePMD-kit) and the best-checkpoint records."""
        if self.ema is not None:
            self.ema = WeightAverage(self.t.model, self.ema.decay)
            if state.get(EMA_KEY):
                self.ema.load_state_dict(state[EMA_KEY])
        self.records = dict(state.get(RECORDS) or {})
        self.restored = True

    # ------------------------------------------------------------------ weight average
    def after_update(self) -> None:
        """After each optimiser step."""
        if self.ema is not None:
            self.ema.update(self.t.model)

    def averaged_state(self, state: dict) -> dict:
        """A checkpoint of the averaged weights from a regular one (no optimiser state)."""
        skip = ("optimizer_state", EMA_KEY)
        averaged = {k: v for k, v in state.items() if k not in skip}
        averaged["model_state"] = self.ema.averaged_state(self.t.model)
        averaged[AVERAGED] = True
        return averaged

    def save_average(self, state: dict) -> None:
        """Rank 0, with each regular checkpoint: the averaged one of the same step."""
        if self.ema is not None:
            path = self.ema_ckpt.save(self.t.step, self.averaged_state(state))
            log.info("saved averaged-weight checkpoint %s", path)

    # ------------------------------------------------------------------ full validation
    def _flows(self) -> dict[str, FullValidator]:
        if self.flows is not None:
            return self.flows
        t, sec, self.flows = self.t, self.section, {}
        wanted = {"live": bool(sec.get("full_validation")),
                  "ema": bool(sec.get("ema_full_validation")) and self.ema is not None}  # fmt: skip
        start = start_step(sec.get("full_val_start", 0.5), t.numb_steps)
        if not any(wanted.values()) or start is None or start > t.numb_steps:
            return self.flows
        training = t.config["training"]
        ckpt_dir = os.path.dirname(os.path.join(t.out_dir, training["save_ckpt"]))
        best_dir = sec.get("save_best_dir")
        best_dir = os.path.join(t.out_dir, best_dir) if best_dir else ckpt_dir
        log_path = os.path.join(t.out_dir, sec.get("full_val_file", "val.log"))
        for flow, on in wanted.items():
            if not on:
                continue
            if not t.valid_systems:
                raise MDTrainError("validating.full_validation: needs training.validation_data")
            ema = flow == "ema"
            self.flows[flow] = FullValidator(
                sec, t.numb_steps, ema_prefix(log_path) if ema else log_path, best_dir,
                "best_ema.ckpt" if ema else "best.ckpt",
                (self.records.get(flow) or {}).get("records")
                if (self.records.get(flow) or {}).get("metric") == validator_metric(sec)
                else None,
                self.restored, t.rt.is_main,
            )  # fmt: skip
        return self.flows

    def validate_fully(self) -> None:
        """The flows due at this step: evaluate, rank, save the best, log."""
        due = {k: v for k, v in self._flows().items() if v.due(self.t.step)}
        if not due:
            return
        t = self.t
        controller_state = t._controller_state()  # a collective: on every rank
        t.gather_optimizer()  # likewise
        for flow, validator in due.items():
            if flow == "ema":
                with self.ema.applied(t.model):
                    sums = self._sums()
            else:
                sums = self._sums()
            error = None
            try:
                validator.run(
                    t.step, sums, lambda path, f=flow: self._save_best(path, f, controller_state)
                )
            except OSError as exc:  # a full disk, a directory in the way: one line
                error = MDTrainError(
                    f"full validation: cannot write {exc.filename}: {exc.strerror}"
                )
            except Exception as exc:  # noqa: BLE001 (re-raised below, after the vote)
                error = exc
            dist_rt.raise_together(error, f"rank 0 failed in the full validation of step {t.step}")

    def _save_best(self, path: str, flow: str, controller_state: dict) -> None:
        state = self.t.state_dict()
        state["controller_state"] = controller_state
        if flow == "ema":
            state = self.averaged_state(state)
        elif self.ema is not None:  # ranked by its live weights: it stands for them
            state[STANDS_FOR] = "live"
        save_checkpoint(path, state)

    def _sums(self) -> torch.Tensor:
        """The error sums of every validation frame (this rank's share, then over ranks)."""
        t = self.t
        total = torch.zeros(4, 3, dtype=torch.float64)
        t.model.eval()
        try:
            for system in t.valid_systems:
                frames = np.arange(t.rt.rank, system.nframes, t.rt.world_size)
                if len(frames) == 0:
                    continue
                chunker = InferenceChunker(device=t.rt.device)
                for part in chunker.run_all(
                    lambda a, b, s=system, f=frames: self._errors(s, f[a:b]),
                    len(frames), system.natoms, system.path,
                ):  # fmt: skip
                    total += part
        finally:
            t.model.train()
        return dist_rt.all_reduce_sum(total.to(t.rt.device)).cpu()

    def _errors(self, system, frames: np.ndarray) -> torch.Tensor:  # noqa: ANN001
        batch = self.t._batch(system, frames)
        pred = self.t.model(*batch.inputs())
        return frame_errors(pred, batch.labels, batch.natoms, batch.box)

    # ------------------------------------------------------------------ the end
    def finish(self, first_step: int) -> str | None:
        """After the last step: the bias refit, then that step's checkpoints written again."""
        t = self.t
        if not self.change_bias or t.step != t.numb_steps or t.numb_steps <= first_step:
            return None
        nbatch = int(t.config["model"].get("data_stat_nbatch", 10))
        changed = dist_rt.run_on_main(refit_energy_bias, t.model, t.train_systems, nbatch)
        dist_rt.broadcast_module(t.model)
        if not changed:
            log.warning("change_bias_after_training: no sampled frame has an energy label")
            return None
        log.info("change_bias_after_training: energy bias now %s", bias_text(t.model))
        return t.save()
