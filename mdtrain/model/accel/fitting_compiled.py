"""The fitting node (``fitting_node``'s value and input gradient of a tanh fitting net, one net
or K stacked) with its elementwise work in compiled loops (``fitting_kernels``): the node the
"kernels" backend runs.

The plain node runs about 70 small elementwise torch operations per atom type and step (64 or
128 rows of 240): each pays the interpreter, the dispatcher and a pass over memory, serially
even at two threads. Here each layer's elementwise steps are one loop per direction; the
products (MKL), tanh and the row sums stay torch's, and every loop computes the same operations
in the same order, so values and gradients equal the plain node's bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mdtrain.model.accel.fitting_kernels import FittingKernels
from mdtrain.model.accel.fitting_node import (
    Node,
    _addmm,
    _fold,
    _mm,
    _offsets,
    _rowsum,
    _split,
    _tr,
    _ValueAndInputGrad,
)
from mdtrain.model.accel.kernels import Kernels
from mdtrain.model.accel.layout import Layout

_loops: dict[int, FittingKernels] = {}  # per loaded library (one per process)


def fitting_node_for(embedding: object) -> Node:
    """The fitting node of a backend, chosen once when its model is built: the compiled loops
    where the backend runs the compiled kernels (``KernelEmbedding.kernels``) and the loops
    round as this torch does (``FittingKernels.usable``), else the plain node."""
    kernels = getattr(embedding, "kernels", None)
    if not isinstance(kernels, Kernels):
        return plain_fitting_node
    if id(kernels) not in _loops:
        _loops[id(kernels)] = FittingKernels(kernels)
    loops = _loops[id(kernels)]
    return CompiledFittingNode(loops) if loops.usable else plain_fitting_node


def _dense(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


class CompiledFittingNode:
    """``(x, layout, *params) -> (energy, g)`` as ``_ValueAndInputGrad.apply``, on the loops
    of one loaded library."""

    def __init__(self, kernels: FittingKernels) -> None:
        self.kernels = kernels

    def __call__(self, x: Tensor, layout: Layout, *params: Tensor) -> tuple[Tensor, Tensor]:
        return _CompiledValueAndInputGrad.apply(x, layout, self.kernels, *params)

    def __deepcopy__(self, memo):
        return self


def plain_fitting_node(x: Tensor, layout: Layout, *params: Tensor) -> tuple[Tensor, Tensor]:
    """The reference node (``fitting_node``), for backends without the compiled loops."""
    return _ValueAndInputGrad.apply(x, layout, *params)


class _CompiledValueAndInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, layout: Layout, lib: FittingKernels, *params: Tensor):
        layers = _split(layout, params)
        x = _dense(x)
        inputs, ts = [x], []
        for (_, skip, _), (w, b, *idt) in zip(layout, layers[:-1], strict=True):
            t = _addmm(b, x, w).tanh_()
            y = lib.combine(t, idt[0] if idt else None, x, skip) if idt or skip else t
            ts.append(t)
            x = y
            inputs.append(x)
        w_out, b_out = layers[-1]
        energy = _addmm(b_out, x, w_out)
        g = _tr(w_out).expand(*x.shape[:-1], w_out.shape[-2])
        upper, slopes = [], []  # per hidden layer: g_(k+1) and p
        for k in range(len(layout) - 1, -1, -1):
            (n_in, skip, _), (w, _, *idt) = layout[k], layers[k]
            p = lib.slope(g, idt[0] if idt else None, ts[k])
            fold = _fold(g, skip, n_in)
            upper.append(g)
            slopes.append(p)
            g = _mm(p, _tr(w)) if fold is None else _addmm(fold, p, _tr(w))
        upper.reverse()
        slopes.reverse()
        ctx.layout, ctx.lib = layout, lib
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*params, *inputs, *ts, *upper, *slopes)
        return energy, g

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, energy_bar: Tensor | None, g_bar: Tensor | None):
        layout, lib = ctx.layout, ctx.lib
        nlayers = len(layout)
        offsets = _offsets(layout)
        nparams = offsets[-1]
        saved = ctx.saved_tensors
        params, rest = saved[:nparams], saved[nparams:]
        inputs = rest[: nlayers + 1]
        ts = rest[nlayers + 1 : 2 * nlayers + 1]
        upper = rest[2 * nlayers + 1 : 3 * nlayers + 1]
        slopes = rest[3 * nlayers + 1 :]
        layers = _split(layout, params)
        grads: list[Tensor | None] = [None] * len(params)

        def accumulate(i: int, value: Tensor) -> None:
            grads[i] = value if grads[i] is None else grads[i].add_(value)

        def accumulate_product(i: int, left: Tensor, right: Tensor) -> None:
            current = grads[i]
            if current is None:
                grads[i] = _mm(left, right)
            elif left.dim() == 2:
                current.addmm_(left, right)
            else:
                current.baddbmm_(left, right)

        t_extra: list[Tensor | None] = [None] * nlayers
        if g_bar is not None:  # reverse of the sweep, bottom layer first
            gb = _dense(g_bar)
            for k in range(nlayers):
                (_, skip, _), (w, _, *idt), o = layout[k], layers[k], offsets[k]
                p_bar = _mm(gb, w)
                accumulate_product(o, _tr(gb), slopes[k])
                ru, t_extra[k], gb = lib.sweep_back(
                    p_bar, ts[k], upper[k], idt[0] if idt else None, gb, skip
                )
                if ru is not None:
                    accumulate(o + 2, _rowsum(ru))
            accumulate(offsets[-2], _rowsum(gb).view(layers[-1][0].shape))
        o = offsets[-2]  # the output layer
        w_out = layers[-1][0]
        if energy_bar is not None:
            accumulate_product(o, _tr(inputs[-1]), energy_bar)
            accumulate(o + 1, _rowsum(energy_bar))
            y_bar = energy_bar * _tr(w_out)
        else:
            y_bar = inputs[-1].new_zeros(*inputs[-1].shape[:-1], w_out.shape[-2])
        for k in range(nlayers - 1, -1, -1):
            (n_in, skip, _), (w, _, *idt), o = layout[k], layers[k], offsets[k]
            yt, a_bar = lib.forward_back(_dense(y_bar), ts[k], idt[0] if idt else None, t_extra[k])
            if yt is not None:
                accumulate(o + 2, _rowsum(yt))
            accumulate_product(o, _tr(inputs[k]), a_bar)
            accumulate(o + 1, _rowsum(a_bar))
            fold = _fold(y_bar, skip, n_in)
            y_bar = _mm(a_bar, _tr(w)) if fold is None else _addmm(fold, a_bar, _tr(w))
        x_bar = y_bar if ctx.needs_input_grad[0] else None
        return (x_bar, None, None, *grads)
