"""The se_e2_a descriptor with its derivative written out: D and, later, dE/d(pair vector) from
dE/dD, as explicit first-order operations instead of a second autograd pass.

The reference (``mdtrain.model.descriptors.se_e2_a``) gives D; forces then need ``autograd.grad`` with
``create_graph`` and the force loss a double backward through every net. Here the embedding
net returns G and dG/ds together, the environment matrix node (``environment_node``) its
derivative coefficients, and ``row_gradients`` with the force node (``force_node``, which
runs ``pull_back_rows``) chain them by hand, so a force loss trains with one first-order
backward.
The embedding work goes through an ``EmbeddingOps`` (``TorchEmbedding`` or ``KernelEmbedding``),
chosen once when the model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from mdtrain.model.accel.embedding_nodes import EmbeddedBlock
from mdtrain.model.accel.environment_node import (
    PairPlan,
    RowKind,
    as_planes,
    as_rows,
    environment_matrix,
    normalisation,
    pair_plan,
    slot_widths,
)
from mdtrain.model.accel.force_node import ForceInputs
from mdtrain.model.descriptors.se_e2_a import DescriptorSeA
from mdtrain.model.network import EmbeddingNet


class EmbeddingOps(Protocol):
    """How one backend evaluates the embedding contraction of a block of slot columns and its
    row gradients (``TorchEmbedding``, ``KernelEmbedding``)."""

    name: str

    def contract(
        self,
        net: EmbeddingNet,
        rows: Tensor,
        n: int,
        pad: Tensor,
        types: Tensor | None,
        tmat: Tensor,
        group: int,
        lo: int,
        mask: Tensor,
        memo: dict | None = None,
    ) -> tuple[Tensor, EmbeddedBlock | None]:
        """``tmat`` plus Σ R̃ᵀG over one block of slot columns (see ``TorchEmbedding``);
        ``memo``: a dict kept with the rows, for what the backend can reuse between the nets
        evaluated on them (a committee's members)."""
        ...

    def row_grads(
        self, tbar: Tensor, blocks: list[EmbeddedBlock], rows: Tensor, width: int
    ) -> Tensor:
        """dE/dR̃ (B, nnei, ``width``) of one group's rows (B, nnei, A) from its dE/dT
        ``tbar`` and its embedding ``blocks`` (in column order); 0 on the columns no block
        evaluates."""
        ...


class ExplicitCache(NamedTuple):
    """What ``row_gradients`` needs from ``contract_environment``."""

    plan: PairPlan  # the environment's group order
    tmats: list[Tensor]  # per group: T = Σ R̃ᵀG / nnei, (B, 4, M)
    rows: list[Tensor]  # per group: normalised rows (B, nnei, 4)
    blocks: list[EmbeddedBlock]
    # the compiled D and dE/dT (``descriptor_products.DescriptorProducts``) or None: torch's
    products: Any = None


def _raw_rows(far: Tensor, r: Tensor, rp: Tensor, w: Tensor, dw: Tensor):
    """se_e2_a's rows ``[w/rp, d·h]`` (M, nnei, 4) and the coefficients ``[h, c0, c1]``
    (3, M, nnei) of their derivative (``h = w/rp²``, ``rp = r + env_protection``), from
    pair-vector planes (3, M, nnei) and (M, nnei) distances: a gradient ``q`` w.r.t. the row
    pulls back to ``dE/dd = d·(q₀c₀ + (q₁₂₃·d)c₁) + h·q₁₂₃`` with ``c₀ = (w'/rp − h)/r`` and
    ``c₁ = (w'/rp − 2h)/(rp·r)``; all 0 in padded slots (w = w' = 0 there)."""
    inv = w / rp
    h = inv / rp
    raw = as_rows(torch.cat([inv.unsqueeze(0), far * h]))
    slope = dw / rp
    coef = torch.stack([h, (slope - h) / r, (slope - 2.0 * h) / (rp * r)])
    return raw, coef


def pull_back_rows(qbar: Tensor, diff: Tensor, coef: Tensor) -> Tensor:
    """dE/dd (…, 3, M, nnei) from dE/d(raw row) ``qbar`` (…, 4, M, nnei), pair vectors
    ``diff`` (3, M, nnei) and ``coef`` (3, M, nnei); see ``_raw_rows``."""
    q_ang = qbar[..., 1:, :, :]
    h, c0, c1 = coef[0], coef[1], coef[2]
    radial = qbar[..., 0, :, :] * c0 + (q_ang * diff).sum(dim=-3) * c1
    return torch.addcmul(diff * radial.unsqueeze(-3), h, q_ang)


def pull_back_rows_t(gbar: Tensor, diff: Tensor, coef: Tensor) -> Tensor:
    """The transpose of ``pull_back_rows``: a cotangent (…, 4, M, nnei) of q from one
    (…, 3, M, nnei) of dE/dd."""
    h, c0, c1 = coef[0], coef[1], coef[2]
    s = (gbar * diff).sum(dim=-3)
    angular = torch.addcmul(diff * (s * c1).unsqueeze(-3), h, gbar)
    return torch.cat([(s * c0).unsqueeze(-3), angular], dim=-3)


SE_E2_A_ROWS = RowKind(_raw_rows, pull_back_rows, pull_back_rows_t, 0)


class RowGroup(NamedTuple):
    """Normalised rows of one group of centres (all of them with ``type_one_side``, else those
    of one centre type) and what the embedding needs of them, the same for every model with
    this descriptor's settings and statistics."""

    rows: Tensor  # (B, nnei, A): A = 4 for se_e2_a, 2 for se_e2_r (``explicit_radial``)
    cols: Tensor  # (B, A, nnei): the rows' transpose, contiguous (plain bmm operands)
    mask: Tensor  # (B, nnei) real neighbours
    types: Tensor | None  # (B,) centre types with ``type_one_side``, else None
    centre: int  # -1 with ``type_one_side``, else the centre type
    widths: list[int]  # per neighbour type: slots up to the last real neighbour of any row
    memo: dict  # the embedding backend's reusable work on these rows (block plans)


class Environment(NamedTuple):
    """Everything the explicit forward computes before any network, in the embedding's group
    order (``PairPlan``): what the force node needs and the normalised rows per group. It
    depends on the frames, the descriptor's settings and its davg/dstd only, so a committee
    whose members share their statistics computes it once
    (``mdtrain.model.accel.committee``)."""

    force: ForceInputs  # row kind, far pair vectors, coefficients, scale (0 if excluded), plan
    pad: Tensor  # (ntypes, nnei, A) normalised rows of padded slots, per centre type
    groups: list[RowGroup]


def explicit_environment(
    desc: DescriptorSeA, diff: Tensor, nlist: Tensor, atype: Tensor, pairs=None
) -> Environment:
    """The network-free part of the explicit forward (see `Environment`); ``pairs``: the
    compiled pair kernels (``pair_kernels.CompiledPairs``) or None (the PyTorch nodes)."""
    return kind_environment(desc, SE_E2_A_ROWS, diff, nlist, atype, None, pairs)


def kind_environment(
    desc,
    kind: RowKind,
    diff: Tensor,
    nlist: Tensor,
    atype: Tensor,
    extend: Callable | None,
    pairs=None,
) -> Environment:
    """The environment of rows of ``kind`` in group order; ``extend`` (or None): the rows the
    embedding sees, from the normalised ones (``explicit_radial`` appends a column of ones,
    which is all the compiled ``pairs`` do with an ``extend``)."""
    plan, nl = pair_plan(desc.type_one_side, desc.ntypes, diff, nlist, atype)
    pad = normalisation(desc).pad  # kept across steps (no per-step conversion)
    if pairs is None:
        (rows, far, coef, scale), mask = environment_matrix(
            desc, kind, plan.vectors, nl, plan.types, atype
        )
        if extend is not None:
            rows = extend(rows)
        cols = rows.transpose(1, 2).contiguous()
        widths = slot_widths(desc, mask, plan.bounds)
        # the virial's float64 vectors: ``far`` itself for a float64 descriptor (equal where
        # real; g is 0 where padded)
        planes = far if far.dtype == torch.float64 else as_planes(plan.vectors, torch.float64)
    else:
        (rows, cols, far, coef, scale, planes), mask = pairs.environment(
            desc, kind, plan.vectors, nl, plan.types, atype, extend is not None
        )
        widths = pairs.slot_widths(desc, mask, plan.bounds)
    if extend is not None:
        pad = extend(pad)
    one = desc.type_one_side
    groups = [
        RowGroup(
            rows[a:b],
            cols[a:b],
            mask[a:b],
            plan.types if one else None,
            -1 if one else c,
            widths[c],
            {},
        )  # fmt: skip
        for c, (a, b) in enumerate(zip(plan.bounds[:-1], plan.bounds[1:], strict=True))
    ]
    force = ForceInputs(kind, far, coef, scale, plan, planes, pairs)
    return Environment(force, pad, groups)


def contract_environment(
    desc: DescriptorSeA, ops: EmbeddingOps, env: Environment, nf: int, natoms: int
) -> tuple[Tensor, ExplicitCache]:
    """Descriptor D (nf, N, M·axis) of ``desc``'s networks on a computed environment, plus
    what ``row_gradients`` needs. With the compiled pair kernels, D and later dE/dT run on
    their compiled products where these were measured to give torch's bits."""
    pairs = env.force.pairs
    products = None if pairs is None else pairs.products
    if products is not None and products.orders(desc.dtype, 4, desc.neuron_out, desc.axis_neuron):
        of_sum = partial(products.descriptor_of_sum, desc)
        d, cache = contract_groups(desc, ops, env, nf, natoms, desc.descriptor_of_t, of_sum)
        return d, cache._replace(products=products)
    return contract_groups(desc, ops, env, nf, natoms, desc.descriptor_of_t)


def contract_groups(
    desc,
    ops: EmbeddingOps,
    env: Environment,
    nf: int,
    natoms: int,
    d_of_t: Callable,
    of_sum: Callable | None = None,
) -> tuple[Tensor, ExplicitCache]:
    """Descriptor D (nf, N, dim_out) from the contraction T/nnei (B, A, M) of each group of
    ``env`` (``d_of_t``: the descriptor's D of it), plus what the row gradients need.
    ``of_sum`` (or None): (D, T/nnei) from the undivided sum T in one node (the compiled
    products, ``DescriptorProducts.descriptor_of_sum``), instead of a division and ``d_of_t``."""
    blocks: list[EmbeddedBlock] = []
    plan = env.force.plan
    if of_sum is None:
        tmats = [_contract(desc, ops, group, env.pad, blocks) / desc.nnei for group in env.groups]
        ds = [d_of_t(t) for t in tmats]
    else:
        sums = [_contract(desc, ops, group, env.pad, blocks) for group in env.groups]
        ds, tmats = (list(x) for x in zip(*map(of_sum, sums), strict=True))
    cache = ExplicitCache(plan, tmats, [group.rows for group in env.groups], blocks)
    if desc.type_one_side:
        return ds[0].view(nf, natoms, desc.dim_out), cache
    d_all = torch.cat(ds)  # (M, dim_out) in group order
    out = d_all.new_empty(nf * natoms, desc.dim_out).index_copy(0, plan.centre, d_all)
    return out.view(nf, natoms, desc.dim_out), cache


def row_gradients(
    desc: DescriptorSeA,
    ops: EmbeddingOps,
    grad: Tensor,
    cache: ExplicitCache,
    atype: Tensor,
) -> list[Tensor]:
    """dE/dR̃ (B, nnei, 4) of each group of rows in the descriptor dtype from dE/dD ``grad``
    (nf, N, M·axis): the explicit backward before the force node (``force_node``; a committee
    runs it for every member at once).

    ``D = TᵀT<`` gives ``dT = T< dDᵀ + [T dD, 0]``; a row R̃ of a real slot enters T
    through ``R̃ᵀG(s)`` with ``s = R̃[0]``, so ``dR̃ = G dTᵀ + [R̃·(G' dTᵀ), 0, 0, 0]``.
    """
    tbar_of = _tbar_of if cache.products is None else cache.products.tbar_of
    return group_row_gradients(desc, ops, grad, cache, atype, tbar_of, 4)


def group_row_gradients(
    desc,
    ops: EmbeddingOps,
    grad: Tensor,
    cache: ExplicitCache,
    atype: Tensor,
    tbar_of: Callable,
    width: int,
) -> list[Tensor]:
    """dE/dR̃ (B, nnei, ``width``) of each group from dE/dD ``grad`` (nf, N, dim_out):
    ``tbar_of(desc, T/nnei, dE/dD rows)`` gives each group's dE/dT (B, A, M), the embedding
    backend its rows' gradients (the first ``width`` of the A columns are kept)."""
    grad = grad.to(desc.dtype).reshape(-1, desc.dim_out)
    if desc.type_one_side:  # one group, in atom order
        return [_row_grad(desc, ops, grad, 0, cache, tbar_of, width)]
    grad = grad.index_select(0, cache.plan.centre)  # every group's rows, in one gather
    bounds = cache.plan.bounds
    return [
        _row_grad(desc, ops, grad[a:b], c, cache, tbar_of, width)
        for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    ]


def _contract(
    desc: DescriptorSeA,
    ops: EmbeddingOps,
    group: RowGroup,
    pad: Tensor,
    blocks: list[EmbeddedBlock],
) -> Tensor:
    """T = Σ R̃ᵀG (B, A, M), not yet divided by nnei, for the rows (B, nnei, A) of ``group``,
    appending the embedding blocks to ``blocks``.

    A group of centre -1 (``type_one_side``) takes one net per neighbour type, rows of any
    centre type; otherwise only rows of that centre type and nets ``centre + t·ntypes``. Each
    net embeds only the leading columns of its block that hold a real neighbour for some row.
    """
    centre, rr = group.centre, group.rows
    tmat = torch.zeros(*group.cols.shape[:2], desc.neuron_out, dtype=rr.dtype, device=rr.device)
    first, last = (centre, centre + 1) if centre >= 0 else (0, desc.ntypes)
    for k, net in enumerate(desc.networks):
        if centre >= 0 and k % desc.ntypes != centre:
            continue
        t = k if centre < 0 else k // desc.ntypes
        lo, hi = desc.offsets[t], desc.offsets[t + 1]
        tmat, block = ops.contract(
            net, group.cols[:, :, lo:hi], group.widths[t], pad[first:last, lo:hi], group.types,
            tmat, max(centre, 0), lo, group.mask[:, lo:hi], group.memo,
        )  # fmt: skip
        if block is not None:
            blocks.append(block)
    return tmat


def _tbar_of(desc: DescriptorSeA, t: Tensor, grad: Tensor) -> Tensor:
    """se_e2_a's dE/dT (B, 4, M) from T/nnei ``t`` and dE/dD (B, M·axis)."""
    axis = desc.axis_neuron
    dd = grad.view(-1, desc.neuron_out, axis)
    tbar = torch.bmm(t[:, :, :axis], dd.transpose(1, 2))
    tbar = torch.cat([tbar[:, :, :axis] + torch.bmm(t, dd), tbar[:, :, axis:]], dim=2)
    return tbar / desc.nnei


def _row_grad(
    desc,
    ops: EmbeddingOps,
    grad: Tensor,
    group: int,
    cache: ExplicitCache,
    tbar_of: Callable,
    width: int,
) -> Tensor:
    """dE/dR̃ (B, nnei, width) of one group from its dE/dD (B, dim_out)."""
    tbar = tbar_of(desc, cache.tmats[group], grad)
    blocks = [block for block in cache.blocks if block.group == group]
    return ops.row_grads(tbar, blocks, cache.rows[group], width)


class ExplicitForm(NamedTuple):
    """What the explicit model needs of one descriptor: its environment (before any network;
    it carries the descriptor's ``RowKind`` for the force node), D from the embedding
    contraction and the environment, and dE/dR̃ from dE/dD per group of rows. Chosen once,
    when the model is built (``mdtrain.model.accel.explicit.FORMS``)."""

    environment: Callable[..., Environment]
    contract: Callable[..., tuple[Tensor, ExplicitCache]]
    row_gradients: Callable[..., list[Tensor]]


SE_E2_A_FORM = ExplicitForm(explicit_environment, contract_environment, row_gradients)
