"""A fitting net's output and its input gradient as one autograd node (tanh nets, eager only),
used by both accelerated backends.

The force loss differentiates the fitting net's input gradient ``g = de/dx`` w.r.t. the
parameters. Written as plain operations, autograd records every product and elementwise step of
the forward and of the gradient sweep and replays them generically; here the backward is written
out (``fitting_sweep``): each weight gradient is accumulated in place, in the layout of the
weight, and the elementwise factors are computed once. One model's per-type nets run as one
node on all atoms (``fitting_types``); a committee's K members as one node per type with
batched products (``members_fitting_with_grad``).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from mdtrain.model.accel.fitting_sweep import DenseNets, flat, reverse, sweep, unflat
from mdtrain.model.accel.fitting_types import TypesValueAndInputGrad, cached_type_rows
from mdtrain.model.accel.layout import Layout, layer_layout, layer_params
from mdtrain.model.fitting import EnergyFitting


def fitting_with_grad(fitting: EnergyFitting, descriptor: Tensor, atype: Tensor):
    """Atomic energies (nf, N) float64 and their gradient w.r.t. D (nf, N, dim_in) in the
    fitting dtype, every type's net in one node (``EnergyFitting.forward`` plus its input
    gradient, as an ordinary first-order function of the parameters)."""
    nets = fitting.networks
    rows = cached_type_rows(atype, len(nets), descriptor.shape[0])
    layout = layer_layout(nets[0].layers[:-1])  # the hidden layers; the output layer is fixed
    params = [p for net in nets for p in layer_params(net.layers)]
    return TypesValueAndInputGrad.apply(descriptor.to(fitting.dtype), rows, layout, *params)


def members_fitting_with_grad(
    fittings: Sequence[EnergyFitting],
    descriptors: Tensor,
    atype: Tensor,
    stacked: Sequence[Sequence[Tensor]] | None = None,
) -> tuple[Tensor, Tensor]:
    """``fitting_with_grad`` of K fitting nets of one architecture (a committee's members),
    each on its own descriptor, ``descriptors`` (K, nf, N, dim_in): energies (K, nf, N) and
    gradients (K, nf, N, dim_in), with one node per type for all K (batched products) instead
    of K nodes of small products. ``stacked``: per type, the nets' parameters already stacked
    in ``layer_params`` order (``stacked.StackedParams.views``); None stacks them here."""
    first = fittings[0]
    k, nf, natoms, dim_in = descriptors.shape
    groups = [torch.nonzero(atype == c).view(-1) for c in range(first.ntypes)]
    inputs = _SplitByType.apply(descriptors, groups)
    energies, grads = [], []
    for c, d_c in enumerate(inputs):
        nets = [f.networks[c] for f in fittings]
        layout = layer_layout(nets[0].layers[:-1])
        if stacked is not None:
            params = list(stacked[c])
        else:
            params = [
                _stacked(p) for p in zip(*(layer_params(n.layers) for n in nets), strict=True)
            ]
        e_c, g_c = _ValueAndInputGrad.apply(d_c.to(first.dtype), layout, *params)
        energies.append(e_c.view(k, nf, -1).to(torch.float64))
        grads.append(g_c.reshape(k, nf, -1, dim_in))
    out = _MergeByType.apply(groups, natoms, *energies)
    grad = _MergeByType.apply(groups, natoms, *grads)
    return out, grad


class _SplitByType(torch.autograd.Function):
    """x (K, nf, N, ...) gathered per atom type (``groups``: the atoms of each type) as (K,
    nf·n_c, ...) tensors. Its backward writes every type's cotangent into one tensor, where
    ``index_select``'s would fill a zero (K, nf, N, ...) tensor per type and add them up."""

    @staticmethod
    def forward(ctx, x: Tensor, groups: list[Tensor]) -> tuple[Tensor, ...]:
        ctx.groups, ctx.shape = groups, x.shape
        k, *_, dim = x.shape
        return tuple(x.index_select(2, idx).reshape(k, -1, dim) for idx in groups)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: Tensor | None):
        if all(g is None for g in grads):
            return None, None
        return _merged(ctx.shape, ctx.groups, grads), None


class _MergeByType(torch.autograd.Function):
    """Per-type parts (K, nf, n_c, ...) put back in atom order (K, nf, N, ...): one tensor
    written in place, where ``zeros(...).index_copy(...)`` per type copies the whole result
    once per type in the forward and again in the backward."""

    @staticmethod
    def forward(ctx, groups: list[Tensor], natoms: int, *parts: Tensor) -> Tensor:
        ctx.groups = groups
        first = parts[0]
        return _merged((*first.shape[:2], natoms, *first.shape[3:]), groups, parts)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        return None, None, *(grad.index_select(2, idx) for idx in ctx.groups)


def _merged(shape, groups: list[Tensor], parts: Sequence[Tensor | None]) -> Tensor:
    """Per-type parts (None: missing) written in atom order into one (K, nf, N, ...) tensor
    of ``shape``: uninitialised where they cover every atom, zeros where some atoms are in
    no group or some parts are missing."""
    known = [(idx, p) for idx, p in zip(groups, parts, strict=True) if p is not None]
    covered = len(known) == len(groups) and sum(len(i) for i in groups) == shape[2]
    like = known[0][1]
    out = like.new_empty(shape) if covered else like.new_zeros(shape)
    for idx, part in known:
        out.index_copy_(2, idx, part.reshape(*shape[:2], len(idx), *shape[3:]))
    return out


def _stacked(params: Sequence[Tensor]) -> Tensor:
    """One parameter of K nets stacked: matrices (K, n, m), vectors (K, 1, n)."""
    stacked = torch.stack(list(params))
    return stacked.unsqueeze(1) if stacked.dim() == 2 else stacked


class _ValueAndInputGrad(torch.autograd.Function):
    """Output (rows, 1) and input gradient (rows, n) of one net on x (rows, n), or of K
    stacked nets on x (K, rows, n)."""

    @staticmethod
    def forward(ctx, x: Tensor, layout: Layout, *params: Tensor) -> tuple[Tensor, Tensor]:
        energy, g, tape = sweep(DenseNets(layout, params), x, layout)
        ctx.layout, ctx.nparams = layout, len(params)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*params, *flat(tape))
        return energy, g

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, energy_bar: Tensor | None, g_bar: Tensor | None):
        layout = ctx.layout
        saved = ctx.saved_tensors
        params, rest = saved[: ctx.nparams], saved[ctx.nparams :]
        tape = unflat(rest, len(layout))
        ops = DenseNets(layout, params)
        x_bar = reverse(ops, layout, tape, energy_bar, g_bar, ctx.needs_input_grad[0])
        return (x_bar, None, *ops.grads.values)
