"""A fitting net's output and its input gradient as one autograd node (tanh nets, eager only),
used by both accelerated backends.

The force loss differentiates the fitting net's input gradient ``g = de/dx`` w.r.t. the
parameters. Written as plain operations, autograd records every product and elementwise step of
the forward and of the gradient sweep and replays them generically; here the backward is written
out: each weight gradient is accumulated in place, in the layout of the weight, and the
elementwise factors are computed once.

Per hidden layer ``k``: ``a = xW + b``, ``t = tanh(a)``, ``y = t·idt + skip(x)``; the output is
``e = x_L w + b_L``. The sweep runs ``g_L = wᵀ``, ``p = (g·idt)(1 − t²)``, ``g_k = p Wᵀ +
fold(g_(k+1))``. Its reverse (cotangent ``ḡ`` of ``g_0``) gives ``p̄ = ḡW``, ``W̄ += ḡᵀp``,
``ḡ_(k+1) = unfold(ḡ) + p̄(1 − t²)·idt``, ``idt̄ += Σ p̄(1 − t²)g``, and a contribution
``−2t·p̄·g·idt`` to ``t̄``; the reverse of the forward then runs as usual with that extra ``t̄``.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from mdtrain.model.accel.layout import Layout, layer_layout, layer_params, tanh_grad
from mdtrain.model.fitting import EnergyFitting


def _unfold(grad: Tensor, skip: int) -> Tensor | None:
    """The reverse of `_fold`: a cotangent of the input side, carried to the output side."""
    if skip == 1:
        return grad
    if skip == 2:
        return torch.cat([grad, grad], dim=-1)
    return None


# The node runs on one net, x (rows, n) with the parameters as the layers hold them, or on K
# nets of one layout at once (a committee's members), x (K, rows, n) with the parameters
# stacked: W (K, n_in, n_out), b and idt (K, 1, n_out). These helpers take either form; on
# the first they are exactly the plain two-dimensional operations.


def _addmm(b: Tensor, x: Tensor, w: Tensor) -> Tensor:
    return torch.addmm(b, x, w) if x.dim() == 2 else torch.baddbmm(b, x, w)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    return torch.mm(a, b) if a.dim() == 2 else torch.bmm(a, b)


def _tr(a: Tensor) -> Tensor:
    return a.t() if a.dim() == 2 else a.transpose(1, 2)


def _rowsum(a: Tensor) -> Tensor:
    """The sum over rows, in the shape of a bias: (n,) or (K, 1, n)."""
    return a.sum(dim=0) if a.dim() == 2 else a.sum(dim=1, keepdim=True)


def _fold(grad: Tensor, skip: int, n_in: int) -> Tensor | None:
    """Gradient reaching a layer's input through its skip connection."""
    if skip == 1:
        return grad
    if skip == 2:
        return torch.add(grad[..., :n_in], grad[..., n_in:])
    return None


def _offsets(layout: Layout) -> list[int]:
    """Index of each layer's first parameter (hidden layers, then the output layer), and the
    total count last."""
    offsets = [0]
    for _, _, has_idt in layout:
        offsets.append(offsets[-1] + (3 if has_idt else 2))
    return [*offsets, offsets[-1] + 2]


def _split(layout: Layout, params: tuple[Tensor, ...]) -> list[tuple[Tensor, ...]]:
    """Per layer (hidden ones, then the output layer): (W, b) or (W, b, idt)."""
    offsets = _offsets(layout)
    return [tuple(params[a:b]) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def fitting_with_grad(fitting: EnergyFitting, descriptor: Tensor, atype: Tensor):
    """Atomic energies (nf, N) float64 and their gradient w.r.t. D (nf, N, dim_in) in the
    fitting dtype, one node per type's net (``EnergyFitting.forward`` plus its input gradient,
    as an ordinary first-order function of the parameters)."""
    nf, natoms = descriptor.shape[0], descriptor.shape[1]
    dim_in = fitting.dim_in
    out = torch.zeros(nf, natoms, dtype=torch.float64, device=descriptor.device)
    grad = torch.zeros(nf, natoms, dim_in, dtype=fitting.dtype, device=descriptor.device)
    for c, net in enumerate(fitting.networks):
        idx = torch.nonzero(atype == c).view(-1)
        d_c = descriptor.index_select(1, idx).reshape(-1, dim_in).to(fitting.dtype)
        layout = layer_layout(net.layers[:-1])  # the hidden layers; the output layer is fixed
        e_c, g_c = _ValueAndInputGrad.apply(d_c, layout, *layer_params(net.layers))
        out = out.index_copy(1, idx, e_c.view(nf, -1).to(torch.float64))
        grad = grad.index_copy(1, idx, g_c.reshape(nf, -1, dim_in))
    return out, grad


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
    @staticmethod
    def forward(ctx, x: Tensor, layout: Layout, *params: Tensor) -> tuple[Tensor, Tensor]:
        layers = _split(layout, params)
        inputs, ts = [x], []
        for (n_in, skip, _), (w, b, *idt) in zip(layout, layers[:-1], strict=True):
            t = _addmm(b, x, w).tanh_()
            y = t * idt[0] if idt else t
            if skip == 1:
                y = y + x
            elif skip == 2:
                lead = x.shape[:-1]
                y = (y.view(*lead, 2, n_in) + x.unsqueeze(-2)).view(*lead, 2 * n_in)
            ts.append(t)
            x = y
            inputs.append(x)
        w_out, b_out = layers[-1]
        energy = _addmm(b_out, x, w_out)
        g = _tr(w_out).expand(*x.shape[:-1], w_out.shape[-2])
        upper, slopes = [], []  # per hidden layer: g_(k+1) and p
        for k in range(len(layout) - 1, -1, -1):
            (n_in, skip, _), (w, _, *idt) = layout[k], layers[k]
            p = tanh_grad(g * idt[0] if idt else g, ts[k])
            fold = _fold(g, skip, n_in)
            upper.append(g)
            slopes.append(p)
            g = _mm(p, _tr(w)) if fold is None else _addmm(fold, p, _tr(w))
        upper.reverse()
        slopes.reverse()
        ctx.layout = layout
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*params, *inputs, *ts, *upper, *slopes)
        return energy, g

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, energy_bar: Tensor | None, g_bar: Tensor | None):
        layout = ctx.layout
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
            gb = g_bar
            for k in range(nlayers):
                (n_in, skip, _), (w, _, *idt), o = layout[k], layers[k], offsets[k]
                p_bar = _mm(gb, w)
                accumulate_product(o, _tr(gb), slopes[k])
                r = tanh_grad(p_bar, ts[k])
                q = upper[k] * idt[0] if idt else upper[k]
                if idt:
                    accumulate(o + 2, _rowsum(r * upper[k]))
                    r = r * idt[0]
                t_extra[k] = torch.mul(ts[k], p_bar).mul_(q).mul_(-2.0)
                nxt = _unfold(gb, skip)
                gb = r if nxt is None else nxt + r
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
            t_bar = y_bar * idt[0] if idt else y_bar
            if idt:
                accumulate(o + 2, _rowsum(y_bar * ts[k]))
            if t_extra[k] is not None:
                t_bar = t_bar + t_extra[k]
            a_bar = tanh_grad(t_bar, ts[k])
            accumulate_product(o, _tr(inputs[k]), a_bar)
            accumulate(o + 1, _rowsum(a_bar))
            fold = _fold(y_bar, skip, n_in)
            y_bar = _mm(a_bar, _tr(w)) if fold is None else _addmm(fold, a_bar, _tr(w))
        x_bar = y_bar if ctx.needs_input_grad[0] else None
        return (x_bar, None, *grads)
