"""bfloat16 autocast around the networks' matrix products (``training.mixed_precision: "bf16"``).

Only the nets run under autocast: a context around the whole model would also round the
descriptor contraction, forces and energies to bfloat16. ``use_bf16`` swaps every embedding
and fitting net of a reference model for a variant that shares its layers (the same parameters
and state_dict keys) and runs its forward under autocast, casting the output back to the
input's dtype at once, so that activations, sums and the loss stay float32/float64.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.energy import EnergyModel
from mdtrain.model.network import EmbeddingNet, FittingNet


class Bf16Autocast(nn.Module):
    """Mixed into a net class: the wrapped net's own layers (shared), its forward under
    bfloat16 autocast and its output back in the input's dtype."""

    def __init__(self, net: nn.Module, device_type: str) -> None:
        nn.Module.__init__(self)
        self.layers = net.layers
        self.device_type = device_type

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            y = super().forward(x)
        return y.to(x.dtype)


class Bf16EmbeddingNet(Bf16Autocast, EmbeddingNet):
    """An ``EmbeddingNet`` with its products in bfloat16."""


class Bf16FittingNet(Bf16Autocast, FittingNet):
    """A ``FittingNet`` with its products in bfloat16."""


def use_bf16(model: EnergyModel, device_type: str) -> int:
    """Swap the model's nets for their bfloat16-autocast variants; returns how many."""
    try:
        torch.autocast(device_type, dtype=torch.bfloat16)
    except (RuntimeError, ValueError) as exc:  # a device without bf16 autocast
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise MDTrainError(
            f'mixed precision "bf16" is not available on {device_type} ({first})'
        ) from None
    swapped = 0
    for nets, variant in (
        (model.descriptor.networks, Bf16EmbeddingNet),
        (model.fitting.networks, Bf16FittingNet),
    ):
        for k, net in enumerate(nets):
            nets[k] = variant(net, device_type)
            swapped += 1
    return swapped


def uses_bf16(model: nn.Module) -> bool:
    """Whether ``model``'s nets run under bfloat16 autocast."""
    return any(isinstance(m, Bf16Autocast) for m in model.modules())
