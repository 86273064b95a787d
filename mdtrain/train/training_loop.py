"""The loop around the training steps, shared by one model (``loop.Trainer``) and a
committee (``committee.CommitteeTrainer``): display, validation, full validation, lcurve.out
rows, checkpoints and preemption. Every rank takes every decision (stop, save) together."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from mdtrain import distributed as dist_rt
from mdtrain.distributed import Runtime
from mdtrain.errors import MDTrainError
from mdtrain.train.display import Display
from mdtrain.train.lcurve import LcurveWriter
from mdtrain.train.loss import EnergyLoss, TensorLoss
from mdtrain.train.lr import Schedule
from mdtrain.train.signals import PreemptionHandler

log = logging.getLogger("mdtrain")


@dataclass
class TrainResult:
    step: int
    preempted: bool
    checkpoint: str | None


class TrainingLoop:
    """The loop around the steps: display, validation, lcurve.out rows, checkpoints and
    preemption, the same for one model (`Trainer`) and a committee
    (``mdtrain.train.committee``). A subclass sets ``config``, ``model``, ``rt``, ``loss``,
    ``numb_steps``, ``step``, ``disp_freq`` and ``save_freq`` and provides the step, the
    validation, the checkpoints and the reports."""

    config: dict
    model: torch.nn.Module
    rt: Runtime
    loss: EnergyLoss | TensorLoss
    lr: Schedule
    numb_steps: int
    step: int
    disp_freq: int
    save_freq: int

    def train_step(self, lr: float) -> Any:
        raise NotImplementedError

    def validate(self, lr: float) -> Any:
        raise NotImplementedError

    def save(self) -> str | None:
        raise NotImplementedError

    def precision_applied(self) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def validate_fully(self) -> None:
        """The ``validating`` section's full validation, when due at ``self.step``."""

    def finish(self, first_step: int) -> str | None:
        """After the last step (``first_step``: where this run started); a path when a
        checkpoint was written again."""
        return None

    def _open_lcurves(self, keys: list[str], append: bool) -> list[LcurveWriter]:
        """This rank's lcurve.out writers (rank 0 only), continuing at ``self.step``."""
        raise NotImplementedError

    def _report(
        self, writers: list[LcurveWriter], display: Display, lr: float, metrics, valid
    ) -> None:
        """The lcurve.out rows and the progress line of a display step."""
        raise NotImplementedError

    def run(
        self, append_lcurve: bool = False, preemption: PreemptionHandler | None = None
    ) -> TrainResult:
        """Train to numb_steps, or until a preemption signal: then every rank stops after the
        same step and a checkpoint of that step is written.

        ``preemption``: an installed handler that outlives this call (the command keeps it
        until the process group is gone, so a launcher's SIGTERM after a failure cannot cut
        the error report short); by default one is installed for the loop only."""
        keys = self.loss.metric_keys()
        writers = self._open_lcurves(keys, append_lcurve)
        display = Display.for_run(self.numb_steps, keys, self.config["training"])
        last_saved, preempted, first_step = None, False, self.step
        self.model.train()
        guard = (
            contextlib.nullcontext(preemption) if preemption is not None else PreemptionHandler()
        )
        try:
            with guard as signals, self.precision_applied():
                while self.step < self.numb_steps:
                    lr = self.lr.value(self.step)
                    began = time.perf_counter()
                    metrics = self.train_step(lr)
                    display.add(time.perf_counter() - began)
                    self.step += 1
                    if display.due(self.step, self.disp_freq):
                        valid = self.validate(lr)
                        self._report(writers, display, lr, metrics, valid)
                    self.validate_fully()
                    done = self.step == self.numb_steps
                    stop = dist_rt.any_rank(signals.requested)
                    if done or stop or self.step % self.save_freq == 0:
                        last_saved = self.save() or last_saved
                    if stop and not done:
                        preempted = True
                        log.warning(
                            "stopping after step %d: %s",
                            self.step,
                            f"{signals.signal_name} received"
                            if signals.requested
                            else "another rank received a preemption signal",
                        )
                        break
                if not preempted:
                    last_saved = self.finish(first_step) or last_saved
        except RuntimeError as exc:
            if self.rt.world_size > 1 and is_collective_failure(exc):
                raise MDTrainError(
                    f"rank {self.rt.rank}: lost contact with the other ranks during step "
                    f"{self.step + 1} ({_first_line(exc)}): a rank died, or stalled longer "
                    f"than training.distributed.timeout ({self._timeout_s():g} s)"
                ) from exc
            raise
        finally:
            for writer in writers:
                writer.close()
        return TrainResult(self.step, preempted, last_saved)

    def _timeout_s(self) -> float:
        return float(self.config["training"].get("distributed", {}).get("timeout", 1800))


def is_collective_failure(exc: BaseException) -> bool:
    """A collective that failed because a peer died or timed out (Gloo and NCCL raise plain
    RuntimeErrors for these, or torch.distributed's DistError subclasses)."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    text = str(exc).lower()
    markers = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout")
    return any(marker in text for marker in markers)


def _first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()[:300]
    return type(exc).__name__
