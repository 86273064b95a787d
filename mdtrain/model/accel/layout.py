"""What the fused nodes and the compiled kernels need to know of a reference net, and the small
tensor helpers their hand-written backwards share.

The nodes see a net as a flat list of parameters plus, per hidden layer, ``(n_in, skip kind,
has idt)``: that is all they need to replay ``ResidualLayer.forward`` without the module.
"""

from __future__ import annotations

import torch
from torch import Tensor

Layout = tuple[tuple[int, int, bool], ...]  # per layer: (n_in, skip kind, has idt)


def layer_layout(layers) -> Layout:
    """(n_in, skip kind, has idt) of each ``ResidualLayer``."""
    return tuple((ly.n_in, ly.skip, ly.idt is not None) for ly in layers)


def layer_params(layers) -> list[Tensor]:
    """The layers' parameters in the order the nodes read them: W, b[, idt] each."""
    params: list[Tensor] = []
    for ly in layers:
        params += [ly.weight, ly.bias] + ([ly.idt] if ly.idt is not None else [])
    return params


def tanh_grad(grad: Tensor, y: Tensor) -> Tensor:
    """``grad · (1 − y²)``, the chain rule through ``y = tanh(x)``, as one fused pass."""
    return torch.ops.aten.tanh_backward(grad, y)


def skip_fold(grad: Tensor, skip: int, n_in: int) -> Tensor | None:
    """Gradient reaching a layer's input through its skip connection."""
    if skip == 1:
        return grad
    if skip == 2:
        return torch.add(grad[:, :n_in], grad[:, n_in:])  # faster than a 2-wide reduction
    return None


def add_cross_product(total: Tensor, left: Tensor, right: Tensor) -> None:
    """``total += leftᵀ right`` over many rows. Split into two halves of rows, the two
    products run as one batched product, one per thread, and are then added: 10–20 % faster
    for these narrow shapes than one product split by the BLAS library."""
    rows = left.shape[0]
    if rows < 512 or left.shape[1] == 1:
        total.addmm_(left.t(), right)
        return
    if rows % 2:  # the last row on its own
        total.addr_(left[-1], right[-1])
        rows -= 1
    half = rows // 2
    halves = torch.bmm(
        left[:rows].view(2, half, -1).transpose(1, 2), right[:rows].view(2, half, -1)
    )
    total += halves[0]
    total += halves[1]


def dense(t: Tensor | None) -> Tensor | None:
    """A cotangent as a contiguous tensor (autograd may hand over expanded or sliced ones)."""
    return None if t is None else t.contiguous()
