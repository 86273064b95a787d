"""The exponential moving average of the weights (``training.enable_ema``), as DeePMD-kit 3.2
keeps it (``deepmd/pt_expt/train/ema.py``).

After every optimiser step each floating-point parameter's average moves towards it,
``ema = ema_decay * ema + (1 - ema_decay) * weights`` (``lerp`` with weight ``1 -
ema_decay``), starting from the weights the training starts with. The average lives beside
the live weights: every regular checkpoint carries it (key ``"ema"``), so a restart continues
both exactly, and every save also writes a checkpoint of the averaged weights under the
prefix ``<save_ckpt stem>_ema<suffix>`` (``model_ema.ckpt-<step>.pt``, no optimiser state),
as DeePMD-kit writes it. A regular checkpoint of such a run stands for the average:
``mdtrain freeze``, ``test`` and the other commands that use a model take its averaged weights
(`mdtrain.model.files.model_weights`), ``--restart`` its live weights and the average.
Buffers (statistics, energy bias) are the model's own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.files import EMA_KEY

log = logging.getLogger("mdtrain")

__all__ = ["EMA_KEY", "WeightAverage", "ema_prefix", "warn_short_average"]


def ema_prefix(save_ckpt: str) -> str:
    """The averaged checkpoints' prefix: ``_ema`` before the last suffix of ``save_ckpt``
    (``model.ckpt`` → ``model_ema.ckpt``), as DeePMD-kit names it."""
    head, tail = os.path.split(save_ckpt)
    stem, dot, suffix = tail.rpartition(".")
    name = f"{stem}_ema.{suffix}" if dot and stem else f"{tail}_ema"
    return os.path.join(head, name)


def warn_short_average(training: dict, numb_steps: int) -> None:
    """Warn before the first step when the average will still hold much of the starting
    weights at the end (``ema_decay ** numb_steps`` over 1 %): freeze and test deploy it, and on
    a short run it is a much worse model than the live weights."""
    if not training.get("enable_ema"):
        return
    decay = float(training.get("ema_decay", 0.999))
    left = decay ** max(int(numb_steps), 0)
    if left > 0.01:
        log.warning(
            "training.enable_ema: after %d steps the average still holds %.1f %% of the "
            "starting weights (ema_decay %g), and freeze and test use the average "
            "(--live-weights for the live ones); raise numb_steps or lower ema_decay",
            numb_steps, 100 * left, decay,
        )  # fmt: skip


class WeightAverage:
    """The moving average of ``model``'s floating-point parameters, by name."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not 0 <= decay < 1:
            raise MDTrainError(f"training.ema_decay must lie in [0, 1), got {decay}")
        self.decay = float(decay)
        with torch.no_grad():
            self.shadow = {n: p.detach().clone() for n, p in self._params(model)}

    @staticmethod
    def _params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in model.named_parameters() if torch.is_floating_point(p)]

    def update(self, model: torch.nn.Module) -> None:
        """Move the average towards the current weights (after an optimiser step)."""
        with torch.no_grad():
            for name, p in self._params(model):
                self.shadow[name].lerp_(p.detach(), 1.0 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "model": {n: t.clone() for n, t in self.shadow.items()}}

    def load_state_dict(self, state: dict, where: str = "checkpoint") -> None:
        saved = state.get("model", {})
        if set(saved) != set(self.shadow):
            raise MDTrainError(f"{where}: its weight average does not fit this model")
        if float(state.get("decay", self.decay)) != self.decay:
            log.warning(
                "%s: weight average kept with decay %s, continued with training.ema_decay %s",
                where, state.get("decay"), self.decay,
            )  # fmt: skip
        with torch.no_grad():
            for name, tensor in self.shadow.items():
                tensor.copy_(saved[name].to(tensor.device, tensor.dtype))

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[None]:
        """The averaged weights in ``model`` inside the block, its own weights after it."""
        params = self._params(model)
        with torch.no_grad():
            kept = [p.detach().clone() for _, p in params]
            for name, p in params:
                p.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), own in zip(params, kept, strict=True):
                    p.copy_(own)

    def averaged_state(self, model: torch.nn.Module) -> dict:
        """``model.state_dict()`` with the averaged weights (buffers the model's own)."""
        with self.applied(model):
            return {k: v.clone() for k, v in model.state_dict().items()}
