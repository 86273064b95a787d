"""Mixed precision (``training.mixed_precision``): which setting switches what, for the
duration of a training run.

* off (null): every operation runs in the networks' precision.
* ``"tf32"``: float32 matrix products may use TensorFloat-32 on CUDA (inputs rounded to a
  10-bit mantissa, float32 accumulation): ``torch.set_float32_matmul_precision("high")``, the
  same switch as ``torch.backends.cuda.matmul.allow_tf32``; the previous setting comes back
  after the run. cuDNN's TF32 switch is on by default in PyTorch and the model has no
  convolutions. No effect on a CPU (one warning).
* ``"bf16"`` / ``"fp16"`` (DeePMD-kit's ``compute_prec`` ``"bfloat16"`` / ``"float16"``): the
  matrix products of the embedding and fitting nets run in that dtype
  (``mdtrain.model.autocast``), each cast back at once, so activations, sums, the descriptor
  contraction, forces, virials, energies and the loss stay in the networks' precision. The
  accelerated backends compute in the parameters' dtype only, so such a model is built as the
  reference model with low-precision layers (``build_model(..., mixed_precision=mode)``);
  this context only checks and announces it. float16 (5 exponent bits) needs the loss scaled
  so that its gradients do not underflow: `mdtrain.train.loss_scale`.

Parameters, gradients and optimiser state stay in the networks' precision (float32, or
DeePMD-kit's ``output_prec``), so a checkpoint is an ordinary model and inference after
mixed-precision training runs in that precision.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from mdtrain.config.precision import MODES, committee_problem, mode_of, network_problem
from mdtrain.errors import MDTrainError
from mdtrain.model.autocast import COMPUTE_DTYPES, compute_mode

__all__ = [
    "MODES",
    "check_networks",
    "committee_problem",
    "mixed_precision",
    "mode_of",
    "network_problem",
]

log = logging.getLogger("mdtrain")


def check_networks(value: object, model_config: dict, where: str) -> None:
    """Raise `MDTrainError` when the ``training.mixed_precision`` ``value`` cannot train this
    model (see `network_problem`)."""
    problem = network_problem(value, model_config, where)
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
    elif mode in COMPUTE_DTYPES:
        _check_low(mode, model, device, announce)
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


def _check_low(mode: str, model: nn.Module, device: torch.device, announce: bool) -> None:
    if compute_mode(model) != mode:
        raise MDTrainError(
            f'mixed precision "{mode}": the model was not built for it '
            f'(build_model(..., mixed_precision="{mode}"))'
        )
    if announce:
        nets = len(model.descriptor.embedding_nets()) + len(model.fitting.networks)
        log.info(
            "mixed precision %s: matrix products of %d networks in %s on %s, everything else "
            "in the networks' precision%s",
            mode, nets, COMPUTE_DTYPES[mode], device.type,
            "; the loss is scaled dynamically" if mode == "fp16" else "",
        )  # fmt: skip
