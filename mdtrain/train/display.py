"""What a run shows every ``disp_freq`` steps: one progress line with the metrics, the
learning rate, the mean training-step time since the previous line, and the ETA.

Apart from the loop so that ``Trainer.run`` reads as the step itself; the step-time
accounting and the wording of the line live here. Two settings of DeePMD-kit decide what is
shown: ``training.disp_training`` false shows nothing at all (no progress lines, no
validation, no lcurve.out rows), and ``training.time_training`` false leaves the time per
step and the ETA out of the line.
"""

from __future__ import annotations

import math


class Display:
    """Training-step times between two progress lines, and the line itself."""

    def __init__(
        self, numb_steps: int, keys: list[str], show: bool = True, timing: bool = True
    ) -> None:
        self.numb_steps, self.keys = numb_steps, keys
        self.show, self.timing = show, timing
        self.total, self.count = 0.0, 0

    @classmethod
    def for_run(cls, numb_steps: int, keys: list[str], training: dict) -> Display:
        """The display a run's ``training`` section asks for."""
        show = bool(training.get("disp_training", True))
        return cls(numb_steps, keys, show, bool(training.get("time_training", True)))

    def due(self, step: int, disp_freq: int) -> bool:
        """Whether ``step`` (1-based, just finished) gets a progress line, a validation and an
        lcurve.out row: the first step and every ``disp_freq``-th, unless display is off."""
        return self.show and (step % disp_freq == 0 or step == 1)

    def add(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1

    def take(self) -> float:
        """The mean since the last call, and start a new window."""
        mean = self.total / max(self.count, 1)
        self.total, self.count = 0.0, 0
        return mean

    def line(self, step: int, lr, metrics, valid) -> str:
        """One model's progress line (``members_line`` of one member)."""
        return self.members_line(step, lr, [metrics], None if valid is None else [valid])

    def members_line(self, step: int, lr, metrics: list, valid: list | None) -> str:
        """One progress line: each metric once, followed by every member's value in member
        order (validation first, then training in brackets); its time per step is the mean
        training-step time since the last line (validation and checkpoints not included; the
        first line's includes the warm-up)."""
        per_step = self.take()
        eta = per_step * (self.numb_steps - step)
        parts = [f"step {step}/{self.numb_steps}"]
        for key in self.keys:
            trn = " ".join(f"{m[key]:.3e}" for m in metrics)
            if valid is not None:
                val = " ".join(f"{v[key]:.3e}" for v in valid)
                parts.append(f"{key} {val} (trn {trn})")
            else:
                parts.append(f"{key} {trn}")
        return self._finish(parts, lr, per_step, eta)

    def _finish(self, parts: list[str], lr, per_step: float, eta: float) -> str:
        parts.append(f"lr {lr:.2e}")
        if self.timing:
            parts.append(f"{per_step:.3f} s/step")
            parts.append(f"ETA {_hms(eta)}")
        return "  ".join(parts)


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
