"""Low-precision matrix products in the networks (``training.mixed_precision``: ``"bf16"``,
``"fp16"`` or DeePMD-kit's ``{"compute_prec": ...}``).

Only the nets' matrix products are rounded: a lower precision around the whole model would
also round the descriptor contraction, forces and energies. ``use_low_precision`` swaps every
hidden layer of the embedding and fitting nets of a reference model for a variant that shares
its parameters (the same state_dict keys) and computes ``x @ W + b`` with ``x``, ``W`` and
``b`` cast to the compute dtype, the product cast back to ``x``'s dtype at once, so that
activations, sums and the loss stay in the networks' precision (float32 or float64). The first
embedding layer (an outer product of one column) and the fitting net's one-output layer are
not matrix products and stay in the networks' precision, as DeePMD-kit keeps its last layer.
Explicit casts, not ``torch.autocast``: autocast leaves float64 operands alone, and DeePMD-kit's
``output_prec: "float64"`` has float64 parameters with float16 products.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mdtrain.model.energy import EnergyModel
from mdtrain.model.network import ResidualLayer

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LowPrecisionLayer(ResidualLayer):
    """A `ResidualLayer`'s own parameters (shared), its matrix product in ``compute_dtype``."""

    def __init__(self, layer: ResidualLayer, compute_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.n_in, self.n_out = layer.n_in, layer.n_out
        self.skip, self.activation = layer.skip, layer.activation
        self.weight, self.bias = layer.weight, layer.bias
        if layer.idt is None:
            self.register_parameter("idt", None)
        else:
            self.idt = layer.idt
        self.compute_dtype = compute_dtype

    def product(self, x: Tensor) -> Tensor:
        if self.n_in == 1:
            return super().product(x)
        c = self.compute_dtype
        return torch.addmm(self.bias.to(c), x.to(c), self.weight.to(c)).to(x.dtype)


def use_low_precision(model: EnergyModel, mode: str) -> int:
    """Give the hidden layers of the model's nets their products in ``mode``'s dtype
    (``"bf16"`` or ``"fp16"``); returns how many layers. The descriptor's nets are its
    ``embedding_nets()``; layers other than ``ResidualLayer`` (the type-embedding
    descriptors' ``DenseLayer``) keep their precision."""
    dtype = COMPUTE_DTYPES[mode]
    swapped = 0
    for nets, keep in ((model.descriptor.embedding_nets(), 0), (model.fitting.networks, 1)):
        for net in nets:  # a fitting net's output layer (``keep``) is no matrix product
            for k in range(len(net.layers) - keep):
                if isinstance(net.layers[k], ResidualLayer):
                    net.layers[k] = LowPrecisionLayer(net.layers[k], dtype)
                    swapped += 1
    return swapped


def compute_mode(model: nn.Module) -> str | None:
    """``"bf16"`` or ``"fp16"`` when ``model``'s nets have low-precision products, else None."""
    for m in model.modules():
        if isinstance(m, LowPrecisionLayer):
            return next(k for k, v in COMPUTE_DTYPES.items() if v == m.compute_dtype)
    return None
