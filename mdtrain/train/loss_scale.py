"""Dynamic loss scaling for float16 products (``mixed_precision`` ``"fp16"``), with the rules
and defaults of torch's ``GradScaler``.

float16 has 5 exponent bits: gradients below about 6e-8 flush to zero in the nets' backward.
The loss is multiplied by ``scale`` before the backward, so the gradients are too, and divided
out (exactly: a power of two) before the optimiser sees them. When a gradient is inf or NaN
(the scale was too large) the step is skipped and the scale halved; after ``interval``
steps without one it doubles. The check runs on the gradients averaged over ranks and every
rank votes, so all of them skip the same steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("mdtrain")


class LossScaler:
    """The scale and its growth counter (both in checkpoints, for exact restarts)."""

    def __init__(
        self,
        scale: float = 2.0**16,
        growth: float = 2.0,
        backoff: float = 0.5,
        interval: int = 2000,
    ) -> None:
        self.scale = float(scale)
        self.growth, self.backoff, self.interval = float(growth), float(backoff), int(interval)
        self.good_steps = 0
        self.skipped = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, params: Sequence[torch.Tensor], any_rank: Callable[[bool], bool]) -> bool:
        """Divide the gradients by the scale; False (skip the step) when any rank's gradient
        is not finite. Updates the scale either way."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        bad = bool(grads) and not bool(
            torch.stack([torch.isfinite(g).all() for g in grads]).all().item()
        )
        if any_rank(bad):
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            log.info("float16 gradients overflowed: step skipped, loss scale now %g", self.scale)
            return False
        self.good_steps += 1
        if self.good_steps >= self.interval:
            self.scale *= self.growth
            self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))
