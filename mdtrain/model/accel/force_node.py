"""The force path of the explicit backends as one autograd node: forces and virials from
dE/dR̃, with the backward a force or virial loss needs.

From dE/dR̃ of every slot (the embedding's row gradients, in the environment's group order)
the forward takes ``q = dE/dR̃ · scale`` (dE/d(raw row)), ``g = dE/dd`` by the descriptor's
pull-back (``RowKind.pull``), ``F_i = Σ_j g_ij − Σ_(k,j)→i g_kj`` and ``virial = −Σ g ⊗ d``,
in float64. All of it is linear in dE/dR̃, so the backward is its transpose: ``ḡ_ij = F̄_i −
F̄_j − V̄ d_ij``, then ``RowKind.pull_t`` and the scale. Autograd would record and replay
about 30 small operations for the same (the slices of the pull-back, the index-add, the
conversions, the virial's product, each with its backward); here they are a dozen larger
ones each way. A committee passes its K members' row gradients together (members as a
leading dimension of the same pairs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mdtrain.model.accel.environment_node import PairPlan, RowKind


class ForceInputs(NamedTuple):
    """What the force path needs of an environment (none of it has a gradient), in its group
    order."""

    kind: RowKind  # the descriptor's pull-back and its transpose
    far: Tensor  # (M, nnei, 3) pair vectors, padded slots moved beyond rcut (descriptor dtype)
    coef: Tensor  # (M, nnei, ·) the pull-back's coefficients, 0 where padded
    scale: Tensor  # (M, nnei, width) 1/dstd, 0 for excluded pairs
    plan: PairPlan


def _virial(g: Tensor, plan: PairPlan) -> Tensor:
    """``−Σ g ⊗ d`` per frame (K, nf, 3, 3) from g (K, M, nnei, 3) float64, group by group
    (each group's rows are frame-major)."""
    k, nf = g.shape[0], plan.nf
    parts = []
    for a, b in zip(plan.bounds[:-1], plan.bounds[1:], strict=True):
        if a < b:
            d_c = plan.vectors[a:b].reshape(nf, -1, 3)
            d_c = d_c if k == 1 else d_c.repeat(k, 1, 1)
            parts.append(torch.bmm(g[:, a:b].reshape(k * nf, -1, 3).transpose(1, 2), d_c))
    total = parts[0]
    for part in parts[1:]:
        total = total.add_(part)
    return total.neg_().view(k, nf, 3, 3)


def _flat_index(plan: PairPlan, members: int) -> Tensor:
    """Each slot's neighbour's force components in a flat (K, nf·N, 3) tensor: index-adds of
    single elements run about 10 times faster than of (K, 3) slices along dimension 1, and
    add in the same order."""
    if members == 1:
        return plan.components
    step = plan.nf * plan.natoms * 3
    offsets = torch.arange(members, device=plan.components.device).view(-1, 1) * step
    return (plan.components.view(1, -1) + offsets).view(-1)


class _ForcePath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs: ForceInputs, members: int, *pieces: Tensor):
        plan = inputs.plan
        rows, nnei = plan.centre.shape[0], plan.vectors.shape[1]
        rbar = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        q = rbar.view(members, rows, nnei, -1) * inputs.scale
        g = inputs.kind.pull(q, inputs.far, inputs.coef).to(torch.float64)
        flat = plan.nf * plan.natoms
        index = _flat_index(plan, members)
        pulled = g.new_zeros(members, flat, 3)
        pulled.view(-1).index_add_(0, index, g.reshape(-1))
        own = g.sum(dim=2)
        force = g.new_empty(members, flat, 3).index_copy_(1, plan.centre, own).sub_(pulled)
        ctx.inputs, ctx.members, ctx.sizes = inputs, members, [p.shape[0] for p in pieces]
        ctx.dtype = rbar.dtype
        ctx.set_materialize_grads(False)
        return force.view(members, plan.nf, plan.natoms, 3), _virial(g, plan)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, force_bar: Tensor | None, virial_bar: Tensor | None):
        inputs, k = ctx.inputs, ctx.members
        plan = inputs.plan
        rows, nnei = plan.centre.shape[0], plan.vectors.shape[1]
        if force_bar is None and virial_bar is None:
            return None, None, *([None] * len(ctx.sizes))
        if force_bar is not None:
            fb = force_bar.reshape(k, -1, 3)
            own = fb.index_select(1, plan.centre).unsqueeze(2)
            other = fb.reshape(-1).index_select(0, _flat_index(plan, k))
            g_bar = own - other.view(k, rows, nnei, 3)
        else:
            g_bar = plan.vectors.new_zeros(k, rows, nnei, 3)
        if virial_bar is not None:
            vt = virial_bar.transpose(-1, -2)
            for a, b in zip(plan.bounds[:-1], plan.bounds[1:], strict=True):
                d_c = plan.vectors[a:b].reshape(1, plan.nf, -1, 3)
                part = torch.matmul(d_c, vt).view(k, b - a, nnei, 3)
                g_bar[:, a:b] -= part
        g_bar = g_bar.to(ctx.dtype)
        q_bar = inputs.kind.pull_t(g_bar, inputs.far, inputs.coef).mul_(inputs.scale)
        grads = q_bar.view(k * rows, nnei, -1).split(ctx.sizes)
        return None, None, *grads


def forces_and_virial(inputs: ForceInputs, pieces: list[Tensor], members: int = 1):
    """Forces (K, nf, N, 3) and virials (K, nf, 3, 3) float64 from dE/dR̃ of each group of
    rows (``pieces``: (B_c, nnei, width) each, members first, each member's groups in order)."""
    return _ForcePath.apply(inputs, members, *pieces)
