"""Exponentially decaying learning rate (DeePMD-compatible ``learning_rate.type = "exp"``).

The schedule is a pure function of the step, so a restart needs no scheduler state: the
loop sets ``param_group["lr"] = lr.value(step)`` before every optimiser step.

Rules (matching DeePMD's):

- ``decay_steps`` is shrunk when it is not smaller than ``numb_steps`` and ``decay_rate``
  is unset: 100 if ``numb_steps // 10 > 100`` else ``numb_steps // 100 + 1``.
- ``decay_rate = (max(stop_lr, 1e-10) / start_lr) ** (decay_steps / numb_steps)`` unless
  given explicitly.
- ``lr(t) = max(stop_lr, start_lr * decay_rate ** floor(t / decay_steps))``
  (``smooth=True`` uses the exponent ``t / decay_steps`` instead of its floor).
"""

from __future__ import annotations

import math

from mdtrain.errors import MDTrainError


class ExpDecayLR:
    """Step-wise exponential decay from ``start_lr`` towards ``stop_lr`` over ``numb_steps``."""

    def __init__(
        self,
        start_lr: float,
        stop_lr: float,
        decay_steps: int,
        numb_steps: int,
        decay_rate: float | None = None,
        smooth: bool = False,
    ) -> None:
        if not start_lr > 0:
            raise MDTrainError(f"learning_rate.start_lr must be > 0, got {start_lr}")
        if stop_lr < 0:
            raise MDTrainError(f"learning_rate.stop_lr must be >= 0, got {stop_lr}")
        if int(decay_steps) < 1:
            raise MDTrainError(f"learning_rate.decay_steps must be >= 1, got {decay_steps}")
        if int(numb_steps) < 1:
            raise MDTrainError(f"training.numb_steps must be >= 1, got {numb_steps}")
        if decay_rate is not None and not 0 < decay_rate <= 1:
            raise MDTrainError(f"learning_rate.decay_rate must lie in (0, 1], got {decay_rate}")
        self.start_lr = float(start_lr)
        self.stop_lr = float(stop_lr)
        self.numb_steps = int(numb_steps)
        self.smooth = bool(smooth)
        steps = int(decay_steps)
        if decay_rate is None and steps >= self.numb_steps:
            steps = 100 if self.numb_steps // 10 > 100 else self.numb_steps // 100 + 1
        self.decay_steps = steps
        if decay_rate is None:
            ratio = max(self.stop_lr, 1e-10) / self.start_lr
            decay_rate = math.exp(math.log(ratio) / (self.numb_steps / self.decay_steps))
        self.decay_rate = float(decay_rate)

    def value(self, step: int) -> float:
        """Learning rate used for the optimiser step with 0-based index ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        exponent = step / self.decay_steps if self.smooth else step // self.decay_steps
        return max(self.stop_lr, self.start_lr * self.decay_rate**exponent)

    def __repr__(self) -> str:
        return (
            f"ExpDecayLR(start_lr={self.start_lr:g}, stop_lr={self.stop_lr:g}, "
            f"decay_steps={self.decay_steps}, decay_rate={self.decay_rate:.6g})"
        )
