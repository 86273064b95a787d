"""The loop around the training steps: display, validation, full validation, lcurve.out
rows, checkpoints and preemption, for every model of a run (one, or a committee's members).
Every rank takes every decision (stop, save) together. The steps themselves are
``loop.Trainer``'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mdtrain import distributed as dist_rt
from mdtrain.distributed import Runtime
from mdtrain.errors import MDTrainError
from mdtrain.train.display import Display
from mdtrain.train.lcurve import LcurveWriter
from mdtrain.train.loss import EnergyLoss, TensorLoss
from mdtrain.train.lr import Schedule
from mdtrain.train.precision import mixed_precision
from mdtrain.train.prefetch import ListPrefetcher
from mdtrain.train.signals import PreemptionHandler

if TYPE_CHECKING:
    from mdtrain.train.member import Member

log = logging.getLogger("mdtrain")


@dataclass
class TrainResult:
    step: int
    preempted: bool
    checkpoint: str | None


class TrainingLoop:
    """The loop around the steps (``loop.Trainer`` sets the attributes below and takes the
    steps and the validation): each model of the run (``members``) writes its own
    lcurve.out rows and checkpoints; the progress line shows every member's values."""

    config: dict
    model: torch.nn.Module
    members: list[Member]
    rt: Runtime
    loss: EnergyLoss | TensorLoss
    lr: Schedule
    numb_steps: int
    step: int
    disp_freq: int
    save_freq: int
    precision: str | None
    prefetch: ListPrefetcher | None = None

    def train_step(self, lr: float) -> list[dict[str, float]]:
        raise NotImplementedError

    def validate(self, lr: float) -> list[dict[str, float]] | None:
        raise NotImplementedError

    def precision_applied(self) -> contextlib.AbstractContextManager:
        """The mixed-precision setting in force inside the block (``run`` trains in it)."""
        return mixed_precision(
            self.precision, self.members[0].model, self.rt.device, self.rt.is_main
        )

    def save(self) -> str | None:
        """Every member's checkpoint of this step (member 0's path returned)."""
        return [member.save() for member in self.members][0]

    def validate_fully(self) -> None:
        """Each member's full validation (``validating``), when due at ``self.step``."""
        for member in self.members:
            member.extras.validate_fully()

    def finish(self, first_step: int) -> str | None:
        """After the last step (``first_step``: where this run started): each member's bias
        refit (``change_bias_after_training``); member 0's path when it wrote a checkpoint
        again."""
        return [member.extras.finish(first_step) for member in self.members][0]

    def _open_lcurves(self, keys: list[str], append: bool) -> list[LcurveWriter | None]:
        """Each member's lcurve.out writer (rank 0 only), continuing at ``self.step``."""
        return [member.open_lcurve(keys, append) for member in self.members]

    def _report(
        self, writers: list[LcurveWriter | None], display: Display, lr: float, metrics, valid
    ) -> None:
        """The lcurve.out rows and the progress line of a display step."""
        for k, writer in enumerate(writers):
            if writer is not None:
                writer.write(self.step, lr, metrics[k], None if valid is None else valid[k])
        log.info(display.members_line(self.step, lr, metrics, valid))

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
            if self.prefetch is not None:
                self.prefetch.close()  # its thread ends with the loop, on an error too
            for writer in writers:
                if writer is not None:
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
