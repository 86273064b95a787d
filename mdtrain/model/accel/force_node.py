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

from typing import Any, NamedTuple

import torch
from torch import Tensor

from mdtrain.model.accel.environment_node import PairPlan, RowKind, as_planes, as_rows


class ForceInputs(NamedTuple):
    """What the force path needs of an environment (none of it has a gradient), in its group
    order; vectors as planes (3, M, nnei) (``environment_node.as_planes``)."""

    kind: RowKind  # the descriptor's pull-back and its transpose
    far: Tensor  # (3, M, nnei) pair vectors, padded slots moved beyond rcut (descriptor dtype)
    coef: Tensor  # (·, M, nnei) the pull-back's coefficients, 0 where padded
    scale: Tensor  # (M, nnei, width) 1/dstd, 0 for excluded pairs
    plan: PairPlan
    planes: Tensor  # (3, M, nnei) float64 pair vectors as given (the virial's)
    # the compiled pair kernels that made the environment (``pair_kernels.CompiledPairs``),
    # which then run the force path too; None: this module's node
    pairs: Any = None


def _flat_index(plan: PairPlan, members: int) -> Tensor:
    """Each slot's neighbour in flat (K, 3, nf·N) planes, per member and component: index-adds
    of single elements run about 10 times faster than of (K, 3) slices along a second
    dimension."""
    flat = plan.nf * plan.natoms
    offsets = torch.arange(members * 3, device=plan.neighbour.device).view(-1, 1) * flat
    return (plan.neighbour.view(1, -1) + offsets).view(-1)


def _frames(x: Tensor, nf: int) -> Tensor:
    """Planes (K, 3, nf·n, nnei) of one group -> (K·nf, 3, n·nnei): each frame's pairs."""
    k = x.shape[0]
    return x.reshape(k, 3, nf, -1).transpose(1, 2).reshape(k * nf, 3, -1)


def virial_of(g: Tensor, inputs: ForceInputs) -> Tensor:
    """``−Σ g ⊗ d`` per frame (K, nf, 3, 3) from g (K, 3, M, nnei) float64, group by group
    (each group's rows are frame-major)."""
    plan, k, nf = inputs.plan, g.shape[0], inputs.plan.nf
    parts = []
    for a, b in zip(plan.bounds[:-1], plan.bounds[1:], strict=True):
        if a < b:
            d_c = _frames(inputs.planes[None, :, a:b], nf)
            d_c = d_c if k == 1 else d_c.repeat(k, 1, 1)
            parts.append(torch.bmm(_frames(g[:, :, a:b], nf), d_c.transpose(1, 2)))
    total = parts[0]
    for part in parts[1:]:
        total = total.add_(part)
    return total.neg_().view(k, nf, 3, 3)


def virial_cotangent(virial_bar: Tensor, inputs: ForceInputs, k: int) -> Tensor:
    """``Σ_b V̄_ab d_b`` (K, 3, M, nnei) float64, the virial's share of g's cotangent, group by
    group and frame by frame (torch's products; both force nodes' backward)."""
    plan = inputs.plan
    out = inputs.planes.new_empty(k, 3, *inputs.planes.shape[1:])
    for a, b in zip(plan.bounds[:-1], plan.bounds[1:], strict=True):
        d_c = inputs.planes[:, a:b].reshape(3, plan.nf, -1).transpose(0, 1)
        part = torch.matmul(virial_bar, d_c)  # (K, nf, 3, n·nnei)
        out[:, :, a:b].view(k, 3, plan.nf, -1).copy_(part.transpose(1, 2))
    return out


class _ForcePath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs: ForceInputs, members: int, virial: bool, *pieces: Tensor):
        plan = inputs.plan
        rows, nnei = plan.centre.shape[0], inputs.far.shape[2]
        rbar = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        q = as_planes(rbar.view(members, rows, nnei, -1) * inputs.scale)
        g = inputs.kind.pull(q, inputs.far, inputs.coef).to(torch.float64)  # (K, 3, M, nnei)
        flat = plan.nf * plan.natoms
        index = _flat_index(plan, members)
        pulled = g.new_zeros(members, 3, flat)
        pulled.view(-1).index_add_(0, index, g.reshape(-1))
        force = g.new_empty(members, 3, flat).index_copy_(2, plan.centre, g.sum(dim=3))
        force = force.sub_(pulled).transpose(1, 2).contiguous()
        ctx.inputs, ctx.members, ctx.sizes = inputs, members, [p.shape[0] for p in pieces]
        ctx.dtype = rbar.dtype
        ctx.set_materialize_grads(False)
        virials = virial_of(g, inputs) if virial else None  # not read: not made
        return force.view(members, plan.nf, plan.natoms, 3), virials

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, force_bar: Tensor | None, virial_bar: Tensor | None):
        inputs, k = ctx.inputs, ctx.members
        plan = inputs.plan
        rows, nnei = plan.centre.shape[0], inputs.far.shape[2]
        if force_bar is None and virial_bar is None:
            return None, None, None, *([None] * len(ctx.sizes))
        if force_bar is not None:
            fb = force_bar.reshape(k, -1, 3).transpose(1, 2).contiguous()  # (K, 3, nf·N)
            own = fb.index_select(2, plan.centre).unsqueeze(3)
            other = fb.view(-1).index_select(0, _flat_index(plan, k))
            g_bar = own - other.view(k, 3, rows, nnei)
        else:
            g_bar = inputs.planes.new_zeros(k, 3, rows, nnei)
        if virial_bar is not None:  # ḡ_a −= Σ_b V̄_ab d_b
            g_bar -= virial_cotangent(virial_bar, inputs, k)
        q_bar = inputs.kind.pull_t(g_bar.to(ctx.dtype), inputs.far, inputs.coef)
        q_bar = as_rows(q_bar).mul_(inputs.scale)
        grads = q_bar.view(k * rows, nnei, -1).split(ctx.sizes)
        return None, None, None, *grads


def forces_and_virial(
    inputs: ForceInputs, pieces: list[Tensor], members: int = 1, virial: bool = True
):
    """Forces (K, nf, N, 3) and virials (K, nf, 3, 3) float64 from dE/dR̃ of each group of
    rows (``pieces``: (B_c, nnei, width) each, members first, each member's groups in order);
    ``virial`` False: None for the virials (a training step whose loss does not read them
    skips their products)."""
    if inputs.pairs is not None:
        return inputs.pairs.forces_and_virial(inputs, pieces, members, virial)
    return _ForcePath.apply(inputs, members, virial, *pieces)
