"""Mixed precision for training on GPUs (``training.mixed_precision``): which setting switches
what, for the duration of a training run.

* off (null): every operation runs in the networks' precision.
* ``"tf32"``: float32 matrix products may use TensorFloat-32 on CUDA (inputs rounded to a
  10-bit mantissa, float32 accumulation): ``torch.set_float32_matmul_precision("high")``, the
  same switch as ``torch.backends.cuda.matmul.allow_tf32``; the previous setting comes back
  after the run. cuDNN's TF32 switch is on by default in PyTorch and the model has no
  convolutions. No effect on a CPU (one warning).
* ``"bf16"``: the matrix products of the embedding and fitting nets run under bfloat16
  autocast on the model's device (``mdtrain.model.autocast``); the networks cast each product
  back to float32 at once, so activations, sums, the descriptor contraction, forces, virials,
  energies and the loss stay float32/float64. The accelerated backends compute in the
  parameters' dtype only, so a bf16 model is built as the reference model with autocast nets
  (``build_model(..., mixed_precision="bf16")``); this context only checks and announces it.

Parameters, gradients and optimiser state stay float32, so a checkpoint is an ordinary float32
model and inference after mixed-precision training runs in float32.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from mdtrain.config.precision import MODES, mode_of, network_problem
from mdtrain.errors import MDTrainError
from mdtrain.model.autocast import uses_bf16

__all__ = ["MODES", "check_networks", "mixed_precision", "mode_of", "network_problem"]

log = logging.getLogger("mdtrain")


def check_networks(mode: str | None, model_config: dict, where: str) -> None:
    """Raise `MDTrainError` when ``mode`` cannot train this model (see `network_problem`)."""
    problem = network_problem(mode, model_config, where)
    if problem:
        raise MDTrainError(problem)


@contextlib.contextmanager
def mixed_precision(
    mode: str | None, model: nn.Module, device: torch.device, announce: bool = True
) -> Iterator[None]:
    """Apply ``mode`` to ``model`` (an EnergyModel on ``device``) inside the block; everything
    is as before afterwards. ``announce``: log the setting (once per run, rank 0)."""
    if mode is None:
        yield
    elif mode == "tf32":
        with _tf32(device, announce):
            yield
    elif mode == "bf16":
        with _bf16(model, device, announce):
            yield
    else:
        raise MDTrainError(f"mixed precision {mode!r} is not one of {', '.join(MODES)}")


@contextlib.contextmanager
def _tf32(device: torch.device, announce: bool) -> Iterator[None]:
    if device.type != "cuda":
        if announce:
            log.warning(
                'mixed precision "tf32" has no effect on %s: TensorFloat-32 exists on NVIDIA '
                "GPUs only; training in float32",
                device.type,
            )
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    if announce:
        log.info("mixed precision tf32: float32 matrix products may use TensorFloat-32")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


@contextlib.contextmanager
def _bf16(model: nn.Module, device: torch.device, announce: bool) -> Iterator[None]:
    if not uses_bf16(model):
        raise MDTrainError(
            'mixed precision "bf16": the model was not built for it '
            '(build_model(..., mixed_precision="bf16"))'
        )
    if announce:
        nets = len(model.descriptor.networks) + len(model.fitting.networks)
        log.info(
            "mixed precision bf16: matrix products of %d networks in bfloat16 (autocast on "
            "%s), everything else in float32/float64",
            nets,
            device.type,
        )
    yield
