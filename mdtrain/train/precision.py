"""Mixed precision for training on GPUs (``training.mixed_precision``): which setting switches
what, for the duration of a training run.

* off (null): every operation runs in the networks' precision.
* ``"tf32"``: float32 matrix products may use TensorFloat-32 on CUDA (inputs rounded to a
  10-bit mantissa, float32 accumulation): ``torch.set_float32_matmul_precision("high")``, the
  same switch as ``torch.backends.cuda.matmul.allow_tf32``; the previous setting comes back
  after the run. cuDNN's TF32 switch is on by default in PyTorch and the model has no
  convolutions. No effect on a CPU (one warning).
* ``"bf16"``: the matrix products of the embedding and fitting nets run under bfloat16
  autocast on the model's device; the networks cast each product back to float32 at once, so
  activations, sums, the descriptor contraction, forces, virials, energies and the loss stay
  float32/float64. The model's fused autograd nodes compute in the parameters' dtype only,
  so the model takes its plain-operation paths for the run (the descriptor's
  ``fused_nodes`` and the nets' ``fused_backward`` off).

Only the networks' entry points run under autocast (see ``_ENTRY_POINTS``): a context around
the whole model would also round the descriptor contraction to bfloat16. Parameters,
gradients and optimiser state stay float32, so a checkpoint is an ordinary float32 model and
inference after mixed-precision training runs in float32.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.network import EmbeddingNet, FittingNet

log = logging.getLogger("mdtrain")

MODES = ("tf32", "bf16")

# The methods through which the descriptor and the fitting call their nets.
_ENTRY_POINTS: dict[type, tuple[str, ...]] = {
    EmbeddingNet: ("forward", "value_and_derivative"),
    FittingNet: ("forward", "value_and_input_grad"),
}


def mode_of(value: Any) -> str | None:
    """``"tf32"``, ``"bf16"`` or None (off) for a ``training.mixed_precision`` value: a mode
    name, or DeePMD's ``{"output_prec": "float32", "compute_prec": "bfloat16"}``."""
    if isinstance(value, dict):
        return "bf16" if value.get("compute_prec") == "bfloat16" else None
    return value if value in MODES else None


def network_problem(mode: str | None, model_config: dict, where: str) -> str | None:
    """Why ``mode`` cannot train this model (its networks must be float32), or None."""
    if mode is None:
        return None
    wide = [
        f"model.{part}.precision"
        for part in ("descriptor", "fitting_net")
        if isinstance(model_config.get(part), dict)
        and model_config[part].get("precision", "default") in ("default", "float64")
    ]
    if not wide:
        return None
    return (
        f'{where} "{mode}" needs float32 networks: set {" and ".join(wide)} to "float32" '
        "(float64 now)"
    )


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
    try:
        torch.autocast(device.type, dtype=torch.bfloat16)
    except (RuntimeError, ValueError) as exc:  # a device without bf16 autocast
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise MDTrainError(
            f'mixed precision "bf16" is not available on {device} ({first})'
        ) from None
    descriptor = model.descriptor
    nets = [m for m in model.modules() if type(m) in _ENTRY_POINTS]
    fused_nodes = descriptor.fused_nodes
    fused = {net: net.fused_backward for net in nets if hasattr(net, "fused_backward")}
    descriptor.fused_nodes = False
    for net in fused:
        net.fused_backward = False
    for net in nets:
        for name in _ENTRY_POINTS[type(net)]:
            method = _bf16_method(getattr(type(net), name), device.type)
            setattr(net, name, types.MethodType(method, net))
    if announce:
        log.info(
            "mixed precision bf16: matrix products of %d networks in bfloat16 (autocast on "
            "%s), everything else in float32/float64",
            len(nets),
            device.type,
        )
    try:
        yield
    finally:
        for net in nets:
            for name in _ENTRY_POINTS[type(net)]:
                delattr(net, name)  # the class's method again
        descriptor.fused_nodes = fused_nodes
        for net, flag in fused.items():
            net.fused_backward = flag


def _bf16_method(function: Callable, device_type: str) -> Callable:
    """``function`` (a network method) under bf16 autocast, its outputs cast back to the
    dtype of its input (float32), also where the method itself does not cast its products
    back (``FittingNet.value_and_input_grad``)."""

    def method(net: nn.Module, x: Tensor) -> Any:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = function(net, x)
        if isinstance(out, Tensor):
            return out.to(x.dtype)
        return tuple(t.to(x.dtype) for t in out)

    return method
