"""The se_e2_a descriptor with its derivative written out: D and, later, dE/d(pair vector) from
dE/dD, as explicit first-order operations instead of a second autograd pass.

The reference (``mdtrain.model.descriptors.se_e2_a``) gives D; forces then need ``autograd.grad`` with
``create_graph`` and the force loss a double backward through every net. Here the embedding
net returns G and dG/ds together, the environment matrix its derivative coefficients, and
``row_gradients`` with ``pull_back_rows`` chain them by hand, so a force loss trains with one
first-order backward.
The embedding work goes through an ``EmbeddingOps`` (``TorchEmbedding`` or ``KernelEmbedding``),
chosen once when the model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from mdtrain.model.accel.embedding_nodes import EmbeddedBlock
from mdtrain.model.descriptors.se_e2_a import DescriptorSeA, smooth_weight
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

    def row_grad(self, tbar: Tensor, block: EmbeddedBlock, rows: Tensor) -> Tensor:
        """dE/dR̃ (B, n, 4) of the block's columns, rows (B, 4, n)."""
        ...


class ExplicitCache(NamedTuple):
    """What ``row_gradients`` needs from ``contract_environment``."""

    diff: Tensor  # (nf, N, nnei, 3) pair vectors (descriptor dtype)
    coef: Tensor  # (nf, N, nnei, 3) [h, c0, c1] of ``env_matrix_and_derivative``, 0 if padded
    scale: Tensor  # (nf, N, nnei, 4) 1/dstd, times 0 for excluded pairs
    tmats: list[Tensor]  # per group: T = Σ R̃ᵀG / nnei, (B, 4, M)
    rows: list[Tensor]  # per group: normalised rows (B, nnei, 4)
    blocks: list[EmbeddedBlock]


def smooth_weight_grad(r: Tensor, rcut_smth: float, rcut: float) -> Tensor:
    """d(smooth_weight)/dr ``= -30u²(1-u)²/(rcut - rcut_smth)``; 0 outside (rcut_smth, rcut)."""
    width = rcut - rcut_smth
    u = (torch.clamp(r, rcut_smth, rcut) - rcut_smth) / width
    v = u * (1.0 - u)
    return v * v * (-30.0 / width)


def switched_distance(
    desc: DescriptorSeA, diff: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Pair vectors with padded slots moved beyond rcut, r, r + env_protection, the switch
    w(r) and w'(r) (both 0 where ~mask): what every explicit environment starts from."""
    far = torch.full_like(diff, 2.0 * desc.rcut)
    diff = torch.where(mask.unsqueeze(-1), diff, far)
    r = torch.linalg.vector_norm(diff, dim=-1, keepdim=True)
    rp = r + desc.env_protection
    keep = mask.unsqueeze(-1).to(diff.dtype)
    w = smooth_weight(r, desc.rcut_smth, desc.rcut) * keep
    dw = smooth_weight_grad(r, desc.rcut_smth, desc.rcut) * keep
    return diff, r, rp, w, dw


def env_matrix_and_derivative(
    desc: DescriptorSeA, diff: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """``desc.env_matrix`` and coefficients ``[h, c0, c1]`` (nf, N, nnei, 3) of its derivative.

    For the row ``[w/rp, d·h]`` (``h = w/rp²``, ``rp = r + env_protection``), a gradient
    ``q`` w.r.t. the row pulls back to ``dE/dd = d·(q₀c₀ + (q₁₂₃·d)c₁) + h·q₁₂₃`` with
    ``c₀ = (w'/rp − h)/r`` and ``c₁ = (w'/rp − 2h)/(rp·r)``; all 0 where ~mask.
    """
    diff, r, rp, w, dw = switched_distance(desc, diff, mask)
    inv = w / rp
    h = inv / rp
    raw = torch.cat([inv, diff * h], dim=-1)
    slope = dw / rp
    coef = torch.cat([h, (slope - h) / r, (slope - 2.0 * h) / (rp * r)], dim=-1)
    return raw, coef


def pull_back_rows(qbar: Tensor, diff: Tensor, coef: Tensor) -> Tensor:
    """dE/dd (…, 3) from dE/d(raw row) ``qbar`` (…, 4); see ``env_matrix_and_derivative``."""
    q_ang = qbar[..., 1:]
    h, c0, c1 = coef[..., 0:1], coef[..., 1:2], coef[..., 2:3]
    radial = qbar[..., 0:1] * c0 + (q_ang * diff).sum(dim=-1, keepdim=True) * c1
    return torch.addcmul(diff * radial, h, q_ang)


class RowGroup(NamedTuple):
    """Normalised rows of one group of centres (all of them with ``type_one_side``, else those
    of one centre type) and what the embedding needs of them, the same for every model with
    this descriptor's settings and statistics."""

    rows: Tensor  # (B, nnei, A): A = 4 for se_e2_a, 2 for se_e2_r (``explicit_radial``)
    cols: Tensor  # (B, A, nnei): the rows' transpose, contiguous (plain bmm operands)
    mask: Tensor  # (B, nnei) real neighbours
    types: Tensor | None  # (B,) centre types with ``type_one_side``, else None
    centre: int  # -1 with ``type_one_side``, else the centre type
    index: Tensor | None  # the group's atoms (centre type), None with ``type_one_side``
    widths: list[int]  # per neighbour type: slots up to the last real neighbour of any row
    memo: dict  # the embedding backend's reusable work on these rows (block plans)


class Environment(NamedTuple):
    """Everything the explicit forward computes before any network: the environment matrix,
    its derivative coefficients and the normalised rows per group. It depends on the frames,
    the descriptor's settings and its davg/dstd only, so a committee whose members share
    their statistics computes it once (``mdtrain.model.accel.committee``)."""

    diff: Tensor  # (nf, N, nnei, 3) pair vectors (descriptor dtype)
    coef: Tensor  # (nf, N, nnei, 3) derivative coefficients, 0 if padded
    scale: Tensor  # (nf, N, nnei, 4) 1/dstd, times 0 for excluded pairs
    pad: Tensor  # (ntypes, nnei, 4) normalised rows of padded slots, per centre type
    groups: list[RowGroup]


def explicit_environment(
    desc: DescriptorSeA, diff: Tensor, nlist: Tensor, atype: Tensor
) -> Environment:
    """The network-free part of the explicit forward (see `Environment`)."""
    mask = nlist >= 0
    diff = diff.to(desc.dtype)
    raw, coef = env_matrix_and_derivative(desc, diff, mask)
    rr, scale, pad = normalised_rows(desc, raw, nlist, atype)
    return grouped_environment(desc, diff, coef, scale.expand_as(rr), pad, rr, mask, atype)


def normalised_rows(
    desc: DescriptorSeA, raw: Tensor, nlist: Tensor, atype: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(raw − davg)/dstd`` by centre type, the pull-back scale ``1/dstd`` (both zero for
    excluded pairs), and the normalised rows of padded slots per centre type."""
    davg_all, dstd_all = desc.davg.to(desc.dtype), desc.dstd.to(desc.dtype)
    dstd = dstd_all[atype]
    rr = (raw - davg_all[atype]) / dstd
    scale = 1.0 / dstd
    if desc.has_exclusions:
        keep = desc.keep_mask(nlist, atype).unsqueeze(-1).to(rr.dtype)
        rr = rr * keep
        scale = scale * keep
    return rr, scale, -davg_all / dstd_all


def grouped_environment(
    desc: DescriptorSeA,
    diff: Tensor,
    coef: Tensor,
    scale: Tensor,
    pad: Tensor,
    rows_all: Tensor,
    mask: Tensor,
    atype: Tensor,
) -> Environment:
    """The environment with its rows (nf, N, nnei, width) in the embedding's groups: one for
    a one-sided descriptor, else one per centre type."""
    nf, natoms, width = rows_all.shape[0], rows_all.shape[1], rows_all.shape[-1]
    groups: list[RowGroup] = []
    if desc.type_one_side:
        rows = rows_all.view(nf * natoms, desc.nnei, width)
        groups.append(row_group(desc, rows, mask.view(-1, desc.nnei), atype.repeat(nf), -1, None))
    else:
        for c in range(desc.ntypes):
            idx = torch.nonzero(atype == c).view(-1)
            rows = rows_all.index_select(1, idx).reshape(-1, desc.nnei, width)
            mask_c = mask.index_select(1, idx).reshape(-1, desc.nnei)
            groups.append(row_group(desc, rows, mask_c, None, c, idx))
    return Environment(diff, coef, scale, pad, groups)


def row_group(
    desc: DescriptorSeA,
    rows: Tensor,
    mask: Tensor,
    types: Tensor | None,
    centre: int,
    index: Tensor | None,
) -> RowGroup:
    """The group of ``rows`` (B, nnei, A) with their real-neighbour ``mask`` (B, nnei)."""
    widths = []
    for t in range(desc.ntypes):
        lo, hi = desc.offsets[t], desc.offsets[t + 1]
        used = torch.nonzero(mask[:, lo:hi].any(dim=0))
        widths.append(int(used.max()) + 1 if used.numel() > 0 else 0)
    cols = rows.transpose(1, 2).contiguous()
    return RowGroup(rows, cols, mask, types, centre, index, widths, {})


def contract_environment(
    desc: DescriptorSeA, ops: EmbeddingOps, env: Environment, nf: int, natoms: int
) -> tuple[Tensor, ExplicitCache]:
    """Descriptor D (nf, N, M·axis) of ``desc``'s networks on a computed environment, plus
    what ``row_gradients`` needs."""
    return contract_groups(desc, ops, env, nf, natoms, desc.descriptor_of_t)


def contract_groups(
    desc, ops: EmbeddingOps, env: Environment, nf: int, natoms: int, d_of_t: Callable
) -> tuple[Tensor, ExplicitCache]:
    """Descriptor D (nf, N, dim_out) from the contraction T/nnei (B, A, M) of each group of
    ``env`` (``d_of_t``: the descriptor's D of it), plus what the row gradients need."""
    blocks: list[EmbeddedBlock] = []
    if desc.type_one_side:
        group = env.groups[0]
        tmat = _contract(desc, ops, group, env.pad, blocks)
        cache = ExplicitCache(env.diff, env.coef, env.scale, [tmat], [group.rows], blocks)
        return d_of_t(tmat).view(nf, natoms, desc.dim_out), cache
    tmats: list[Tensor] = []
    rows_of: list[Tensor] = []
    out = torch.zeros(nf, natoms, desc.dim_out, dtype=env.diff.dtype, device=env.diff.device)
    for group in env.groups:
        tmat = _contract(desc, ops, group, env.pad, blocks)
        d = d_of_t(tmat).view(nf, -1, desc.dim_out)
        out = out.index_copy(1, group.index, d)
        tmats.append(tmat)
        rows_of.append(group.rows)
    return out, ExplicitCache(env.diff, env.coef, env.scale, tmats, rows_of, blocks)


def row_gradients(
    desc: DescriptorSeA,
    ops: EmbeddingOps,
    grad: Tensor,
    cache: ExplicitCache,
    atype: Tensor,
) -> Tensor:
    """dE/dR̃ (nf, N, nnei, 4) in the descriptor dtype from dE/dD ``grad`` (nf, N, M·axis):
    the explicit backward before the pull-back through the environment matrix
    (``pull_back_rows``; a committee pulls every member's back at once).

    ``D = TᵀT<`` gives ``dT = T< dDᵀ + [T dD, 0]``; a row R̃ of a real slot enters T
    through ``R̃ᵀG(s)`` with ``s = R̃[0]``, so ``dR̃ = G dTᵀ + [R̃·(G' dTᵀ), 0, 0, 0]``.
    """
    return group_row_gradients(desc, ops, grad, cache, atype, _tbar_of, 4)


def group_row_gradients(
    desc,
    ops: EmbeddingOps,
    grad: Tensor,
    cache: ExplicitCache,
    atype: Tensor,
    tbar_of: Callable,
    width: int,
) -> Tensor:
    """dE/dR̃ (nf, N, nnei, ``width``) from dE/dD ``grad`` (nf, N, dim_out), group by group:
    ``tbar_of(desc, T/nnei, dE/dD rows)`` gives each group's dE/dT (B, A, M), the embedding
    backend its rows' gradients (the first ``width`` of the A columns are kept)."""
    nf, natoms = grad.shape[0], grad.shape[1]
    grad = grad.to(desc.dtype)
    if desc.type_one_side:
        rbar = _row_grad(desc, ops, grad.reshape(nf * natoms, -1), 0, cache, tbar_of, width)
        rbar = rbar.view(nf, natoms, desc.nnei, width)
    else:
        rbar = torch.zeros(nf, natoms, desc.nnei, width, dtype=grad.dtype, device=grad.device)
        for c in range(desc.ntypes):
            idx = torch.nonzero(atype == c).view(-1)
            g_c = grad.index_select(1, idx).reshape(-1, desc.dim_out)
            rbar_c = _row_grad(desc, ops, g_c, c, cache, tbar_of, width)
            rbar = rbar.index_copy(1, idx, rbar_c.view(nf, -1, desc.nnei, width))
    return rbar


def _contract(
    desc: DescriptorSeA,
    ops: EmbeddingOps,
    group: RowGroup,
    pad: Tensor,
    blocks: list[EmbeddedBlock],
) -> Tensor:
    """T/nnei (B, A, M) for the rows (B, nnei, A) of ``group``, appending the embedding blocks
    to ``blocks``.

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
    return tmat / desc.nnei


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
    rows = cache.rows[group]
    tbar = tbar_of(desc, cache.tmats[group], grad)
    pieces: list[Tensor] = []
    col = 0
    for block in cache.blocks:
        if block.group != group:
            continue
        lo, n = block.lo, block.n
        if lo > col:
            pieces.append(rows.new_zeros(rows.shape[0], lo - col, width))
        rbar = ops.row_grad(tbar, block, rows[:, lo : lo + n].transpose(1, 2))
        pieces.append(rbar if rbar.shape[2] == width else rbar[:, :, :width])
        col = lo + n
    if col < desc.nnei:
        pieces.append(rows.new_zeros(rows.shape[0], desc.nnei - col, width))
    return torch.cat(pieces, dim=1)


class ExplicitForm(NamedTuple):
    """What the explicit model needs of one descriptor: its environment (before any network),
    D from the embedding contraction and the environment, dE/dR̃ from dE/dD, and the pull-back
    of dE/dR̃ (times ``Environment.scale``) to dE/d(pair vector). Chosen once, when the model
    is built (``mdtrain.model.accel.explicit.FORMS``)."""

    environment: Callable[..., Environment]
    contract: Callable[..., tuple[Tensor, ExplicitCache]]
    row_gradients: Callable[..., Tensor]
    pull_back: Callable[[Tensor, Tensor, Tensor], Tensor]


SE_E2_A_FORM = ExplicitForm(
    explicit_environment, contract_environment, row_gradients, pull_back_rows
)
