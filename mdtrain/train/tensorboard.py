"""TensorBoard scalars of a training run: ``training.tensorboard``, ``tensorboard_log_dir`` and
``tensorboard_freq``, DeePMD-kit's keys and defaults (off, ``log``, 1).

The rows of ``lcurve.out`` are mirrored (`mdtrain.train.lcurve.LcurveWriter` hands them on):
at a display step whose number is a multiple of ``tensorboard_freq``, and at step 1, the
learning rate as ``Default/lr``, every training metric as ``Default/<key>`` (``rmse_e``,
``rmse_f``, ...: DeePMD-kit's tags for the training batch's values) and every validation
metric as ``Default/<key>_val``. DeePMD-kit writes them at every step; mdtrain computes them at
display steps (``disp_freq``). The log directory is relative to the run's output directory
(a committee member's to its ``member-k/``). Needs the ``tensorboard`` package, an optional
extra (``pip install 'mdtrain[tensorboard]'``); without it training stops before its first
step with one line saying so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from mdtrain.errors import MDTrainError

TAG = "Default"  # DeePMD-kit's task key of a single-task model


class TensorboardWriter:
    """Scalars of the display steps (see the module docstring), with the lcurve writer's
    ``write``/``close`` interface."""

    def __init__(self, log_dir: str, freq: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise MDTrainError(
                "training.tensorboard: the tensorboard package is not installed "
                "(pip install 'mdtrain[tensorboard]' or pip install tensorboard)"
            ) from None
        self.freq = int(freq)
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)

    def write(
        self,
        step: int,
        lr: float,
        train: Mapping[str, float],
        valid: Mapping[str, float] | None = None,
    ) -> None:
        if step % self.freq and step != 1:
            return
        self._writer.add_scalar(f"{TAG}/lr", float(lr), step)
        for key in sorted(train):
            self._writer.add_scalar(f"{TAG}/{key}", float(train[key]), step)
        for key in sorted(valid or {}):
            self._writer.add_scalar(f"{TAG}/{key}_val", float(valid[key]), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def tensorboard_writer(training: dict, out_dir: str) -> TensorboardWriter | None:
    """The run's writer when ``training.tensorboard`` asks for one (else None)."""
    if not training.get("tensorboard", False):
        return None
    log_dir = os.path.join(out_dir, training.get("tensorboard_log_dir", "log"))
    return TensorboardWriter(log_dir, training.get("tensorboard_freq", 1))
