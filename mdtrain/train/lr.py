"""Learning-rate schedules: DeePMD-kit 3.2's ``exp`` (with ``smooth``), ``cosine`` and ``wsd``,
each with an optional linear warm-up.

A schedule is a pure function of the step, so a restart needs no scheduler state: the loop
sets ``param_group["lr"] = lr.value(step)`` before every optimiser step.

Rules (DeePMD-kit's, ``deepmd/dpmodel/utils/learning_rate.py``):

- ``stop_lr`` is ``start_lr * stop_lr_ratio`` when the ratio is given, else 5e-8 when unset.
- Warm-up: ``warmup_steps`` (or ``int(warmup_ratio * numb_steps)``) steps going linearly
  from ``warmup_start_factor * start_lr`` to ``start_lr``; the decay then runs over the
  ``T = numb_steps - warmup_steps`` remaining steps, ``t = step - warmup_steps``.
- ``exp``: ``decay_steps`` is shrunk when it is not smaller than ``T`` and ``decay_rate`` is
  unset: 100 if ``T // 10 > 100`` else ``T // 100 + 1``; ``decay_rate = (max(stop_lr,
  1e-10) / start_lr) ** (decay_steps / T)`` unless given; ``lr(t) = max(stop_lr, start_lr *
  decay_rate ** floor(t / decay_steps))`` (``smooth``: the exponent ``t / decay_steps``).
- ``cosine``: ``start_lr * (f + (1 - f) / 2 * (1 + cos(pi * t / T)))`` with ``f = stop_lr /
  start_lr``, and ``start_lr * f`` from ``t = T`` on.
- ``wsd``: ``start_lr`` for ``T - D`` steps, then ``D = max(1, min(int(decay_phase_ratio *
  numb_steps), T))`` steps of ``decay_type`` towards ``stop_lr``, ``stop_lr`` from ``t = T``.

The arithmetic follows DeePMD-kit's order of operations in float64, so the values agree to
the last bit or two (``tests/interop/test_lr_interop.py`` measures it).
"""

from __future__ import annotations

import math

from mdtrain.errors import MDTrainError

DEFAULT_STOP_LR = 5e-8


class Schedule:
    """The warm-up shared by every schedule; a subclass gives the decay after it."""

    def __init__(
        self,
        start_lr: float,
        stop_lr: float,
        numb_steps: int,
        warmup_steps: int = 0,
        warmup_start_factor: float = 0.0,
    ) -> None:
        if not start_lr > 0:
            raise MDTrainError(f"learning_rate.start_lr must be > 0, got {start_lr}")
        if stop_lr < 0:
            raise MDTrainError(f"learning_rate.stop_lr must be >= 0, got {stop_lr}")
        if int(numb_steps) < 1:
            raise MDTrainError(f"training.numb_steps must be >= 1, got {numb_steps}")
        if not 0 <= int(warmup_steps) < int(numb_steps):
            raise MDTrainError(
                f"learning_rate.warmup_steps ({warmup_steps}) must be smaller than the "
                f"number of steps ({numb_steps})"
            )
        self.start_lr = float(start_lr)
        self.stop_lr = float(stop_lr)
        self.numb_steps = int(numb_steps)
        self.warmup_steps = int(warmup_steps)
        self.warmup_start_lr = float(warmup_start_factor) * self.start_lr
        self.decay_total = self.numb_steps - self.warmup_steps

    def value(self, step: int) -> float:
        """Learning rate used for the optimiser step with 0-based index ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.warmup_steps == 0:
            return self.decay(step)
        if step < self.warmup_steps:
            progress = float(step) / self.warmup_steps
            return self.warmup_start_lr + (self.start_lr - self.warmup_start_lr) * progress
        return self.decay(float(step - self.warmup_steps))

    def decay(self, t: float) -> float:
        raise NotImplementedError


class ExpDecayLR(Schedule):
    """Step-wise (or, ``smooth``, continuous) exponential decay from ``start_lr`` towards
    ``stop_lr``."""

    def __init__(
        self,
        start_lr: float,
        stop_lr: float,
        decay_steps: int,
        numb_steps: int,
        decay_rate: float | None = None,
        smooth: bool = False,
        warmup_steps: int = 0,
        warmup_start_factor: float = 0.0,
    ) -> None:
        super().__init__(start_lr, stop_lr, numb_steps, warmup_steps, warmup_start_factor)
        if int(decay_steps) < 1:
            raise MDTrainError(f"learning_rate.decay_steps must be >= 1, got {decay_steps}")
        if decay_rate is not None and not 0 < decay_rate <= 1:
            raise MDTrainError(f"learning_rate.decay_rate must lie in (0, 1], got {decay_rate}")
        self.smooth = bool(smooth)
        total = self.decay_total
        steps = int(decay_steps)
        if decay_rate is None and steps >= total:
            steps = 100 if total // 10 > 100 else total // 100 + 1
        self.decay_steps = steps
        if decay_rate is None:
            ratio = max(self.stop_lr, 1e-10) / self.start_lr
            decay_rate = math.exp(math.log(ratio) / (total / self.decay_steps))
        self.decay_rate = float(decay_rate)

    def decay(self, t: float) -> float:
        exponent = t / self.decay_steps if self.smooth else t // self.decay_steps
        return max(self.stop_lr, self.start_lr * self.decay_rate**exponent)

    def __repr__(self) -> str:
        return (
            f"ExpDecayLR(start_lr={self.start_lr:g}, stop_lr={self.stop_lr:g}, "
            f"decay_steps={self.decay_steps}, decay_rate={self.decay_rate:.6g})"
        )


class CosineLR(Schedule):
    """Cosine annealing from ``start_lr`` to ``stop_lr`` over the decay phase."""

    def decay(self, t: float) -> float:
        factor = self.stop_lr / self.start_lr
        if t >= self.decay_total:
            return self.start_lr * factor
        wave = 1 + math.cos(math.pi * (t / self.decay_total))
        return self.start_lr * (factor + 0.5 * (1 - factor) * wave)


WSD_DECAY_TYPES = ("inverse_linear", "cosine", "linear")


class WsdLR(Schedule):
    """Warm-up, stable phase at ``start_lr``, then ``decay_type`` down to ``stop_lr``."""

    def __init__(
        self,
        start_lr: float,
        stop_lr: float,
        numb_steps: int,
        warmup_steps: int = 0,
        warmup_start_factor: float = 0.0,
        decay_phase_ratio: float = 0.1,
        decay_type: str = "inverse_linear",
    ) -> None:
        super().__init__(start_lr, stop_lr, numb_steps, warmup_steps, warmup_start_factor)
        if not self.stop_lr > 0:
            raise MDTrainError(f"learning_rate.stop_lr must be > 0 for wsd, got {stop_lr}")
        if not 0 < decay_phase_ratio <= 1:
            raise MDTrainError(
                f"learning_rate.decay_phase_ratio must lie in (0, 1], got {decay_phase_ratio}"
            )
        if decay_type not in WSD_DECAY_TYPES:
            raise MDTrainError(f"learning_rate.decay_type: unknown rule {decay_type!r}")
        self.decay_type = decay_type
        phase = int(decay_phase_ratio * self.numb_steps)
        self.decay_phase_steps = max(1, min(phase, self.decay_total))
        self.stable_steps = self.decay_total - self.decay_phase_steps

    def decay(self, t: float) -> float:
        start, stop = self.start_lr, self.stop_lr
        if t >= self.decay_total:
            return stop
        if t < self.stable_steps:
            return start
        tau = min(max((t - self.stable_steps) / self.decay_phase_steps, 0.0), 1.0)
        if self.decay_type == "inverse_linear":
            return 1.0 / (tau / stop + (1.0 - tau) / start)
        if self.decay_type == "cosine":
            return stop + (start - stop) * 0.5 * (1.0 + math.cos(math.pi * tau))
        return start + (stop - start) * tau


def warmup_steps_of(lr_cfg: dict, numb_steps: int) -> int:
    """``warmup_steps``, or ``int(warmup_ratio * numb_steps)`` when the ratio is given."""
    ratio = lr_cfg.get("warmup_ratio")
    return int(ratio * numb_steps) if ratio is not None else int(lr_cfg.get("warmup_steps", 0))


def stop_lr_of(lr_cfg: dict) -> float:
    """``stop_lr``, or ``start_lr * stop_lr_ratio``, or the default 5e-8."""
    if lr_cfg.get("stop_lr") is not None:
        return float(lr_cfg["stop_lr"])
    if lr_cfg.get("stop_lr_ratio") is not None:
        return float(lr_cfg["start_lr"]) * float(lr_cfg["stop_lr_ratio"])
    return DEFAULT_STOP_LR


def make_schedule(lr_cfg: dict, numb_steps: int) -> Schedule:
    """The schedule of a (completed) ``learning_rate`` section for a run of ``numb_steps``."""
    kind = lr_cfg.get("type", "exp")
    start, stop = float(lr_cfg["start_lr"]), stop_lr_of(lr_cfg)
    warmup = warmup_steps_of(lr_cfg, numb_steps)
    factor = float(lr_cfg.get("warmup_start_factor", 0.0))
    if kind == "exp":
        return ExpDecayLR(
            start, stop, lr_cfg.get("decay_steps", 5000), numb_steps, lr_cfg.get("decay_rate"),
            bool(lr_cfg.get("smooth", False)), warmup, factor,
        )  # fmt: skip
    if kind == "cosine":
        return CosineLR(start, stop, numb_steps, warmup, factor)
    if kind == "wsd":
        return WsdLR(
            start, stop, numb_steps, warmup, factor,
            float(lr_cfg.get("decay_phase_ratio", 0.1)), lr_cfg.get("decay_type", "inverse_linear"),
        )  # fmt: skip
    raise MDTrainError(f"learning_rate.type: unknown schedule {kind!r}")
