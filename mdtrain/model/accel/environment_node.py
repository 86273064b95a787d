"""The environment matrix of the explicit backends as one autograd node, on rows in the
embedding's group order.

The explicit model needs, per neighbour slot, the normalised row R̃ (what the embedding nets
see), the coefficients of its derivative with respect to the pair vector (what the force
path pulls dE/dR̃ back with) and the scale ``1/dstd``. Written as plain operations this was
some 70 small ``aten`` calls (masks, the switch and its derivative, the rows, one copy per
group of centres, one synchronisation per group and neighbour type for the slot widths).
Here the rows are put in group order once (``PairPlan``: all centres for a one-sided
descriptor, else the centres of each type in turn, frame-major in each group), the matrix,
its coefficients and its scale are one node (``environment_matrix``) whose backward is the
pull-back ``dE/dd`` (the same function the force path runs forward), and the groups are
views of its output. What differs between descriptors is a ``RowKind``: the raw row and its
coefficients from the switched distance, the pull-back and its transpose.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from mdtrain.model.accel.per_types import kept_per_types
from mdtrain.model.descriptors.base import smooth_weight


class RowKind(NamedTuple):
    """One descriptor's environment rows and their derivative (se_e2_a: 4 columns and 3
    coefficients; se_e2_r: 1 and 1), chosen once where the model is built."""

    # (far pair vectors (3, M, nnei), r, r + env_protection, w, w' (M, nnei) each) ->
    # (raw rows (M, nnei, width), coefficients (·, M, nnei))
    raw: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    # dE/d(raw row) q (…, width, M, nnei) -> dE/dd (…, 3, M, nnei): pull(q, far, coefficients)
    pull: Callable[[Tensor, Tensor, Tensor], Tensor]
    # the transpose of ``pull``: a cotangent of dE/dd (…, 3, M, nnei) -> one of q
    pull_t: Callable[[Tensor, Tensor, Tensor], Tensor]
    # the compiled kernels' name for these rows (``pair_kernels``): 0 se_e2_a, 1 se_e2_r
    code: int = -1


class PairPlan(NamedTuple):
    """Where the rows of an environment in group order come from and go to."""

    centre: Tensor  # (M,) int64: frame·N + atom of each row
    neighbour: Tensor  # (M·nnei,) int64: frame·N + atom of each slot's neighbour (0 if padded)
    types: Tensor  # (M,) each row's centre type
    bounds: list[int]  # the groups' first rows, and M last
    nf: int
    natoms: int
    vectors: Tensor  # (M, nnei, 3) float64 pair vectors as given (arbitrary where padded)


class _Order(NamedTuple):
    """What a plan takes from the atom types alone (the same for every step of a system)."""

    centre: Tensor
    types: Tensor
    bounds: list[int]
    base: Tensor | None  # (M, 1) frame·N of each row's frame; None when all 0 (one frame)
    identity: bool  # centre is 0, 1, …, M-1: the lists need no reordering


def _group_order(one_side: bool, ntypes: int, nf: int, natoms: int, atype: Tensor) -> _Order:
    """The rows' group order (see `pair_plan`) from the atom types; integer tensors only."""
    device = atype.device
    if one_side:
        centre = torch.arange(nf * natoms, device=device)
        types = atype.repeat(nf)
        bounds = [0, nf * natoms]
    else:
        frames = torch.arange(nf, device=device) * natoms
        parts = [torch.nonzero(atype == c).view(1, -1) + frames.view(nf, 1) for c in range(ntypes)]
        bounds = [0]
        for part in parts:
            bounds.append(bounds[-1] + part.numel())
        centre = torch.cat([p.reshape(-1) for p in parts])
        types = atype.index_select(0, centre % natoms)
    base = None
    if nf > 1:
        base = (torch.div(centre, natoms, rounding_mode="floor") * natoms).view(-1, 1)
    identity = one_side or bool(torch.equal(centre, torch.arange(nf * natoms, device=device)))
    return _Order(centre, types, bounds, base, identity)


class Normalisation(NamedTuple):
    """A descriptor's ``davg``, ``dstd`` in its dtype (contiguous) and the padded slots' row
    ``−davg/dstd``, with what they were made from."""

    davg: Tensor
    dstd: Tensor
    pad: Tensor
    source: tuple  # (davg, dstd, their versions, dtype)


_NORMS: dict[tuple, Normalisation] = {}  # by (id(davg), id(dstd), dtype)
_NORMS_MOST = 16
_NORMS_LOCK = threading.Lock()


def normalisation(desc) -> Normalisation:
    """``desc.davg``, ``desc.dstd`` in ``desc.dtype`` and ``−davg/dstd``, kept while the two
    buffers are the same tensors at the same version: they change only when statistics are
    set or a checkpoint is loaded (in place, which bumps the version, or by new tensors), so
    a training step no longer converts them and divides again (about 0.13 ms of one thread a
    float32 step). Made outside inference mode, so that values first made by an inference
    call serve a training step; never written to."""
    davg, dstd, dtype = desc.davg, desc.dstd, desc.dtype
    if davg.is_inference() or dstd.is_inference():  # no version counter to check
        return _normalised(davg, dstd, dtype, ())
    source = (davg, dstd, davg._version, dstd._version, dtype)
    key = (id(davg), id(dstd), dtype)
    with _NORMS_LOCK:
        kept = _NORMS.get(key)
    if (
        kept is not None
        and kept.source[0] is davg
        and kept.source[1] is dstd
        and kept.source[2:] == source[2:]
    ):
        return kept
    with torch.inference_mode(False):
        made = _normalised(davg, dstd, dtype, source)
    with _NORMS_LOCK:
        _NORMS.pop(key, None)
        _NORMS[key] = made
        while len(_NORMS) > _NORMS_MOST:
            _NORMS.pop(next(iter(_NORMS)))
    return made


def _normalised(davg: Tensor, dstd: Tensor, dtype: torch.dtype, source: tuple) -> Normalisation:
    avg, std = davg.to(dtype), dstd.to(dtype)
    pad = -avg / std  # the operations the environment used per step
    return Normalisation(avg.contiguous(), std.contiguous(), pad, source)


def pair_plan(one_side: bool, ntypes: int, diff: Tensor, nlist: Tensor, atype: Tensor):
    """The group order of ``nlist`` (nf, N, nnei): one group in atom order for a one-sided
    descriptor, else one per centre type. Returns the plan and the lists in that order."""
    nf, natoms, nnei = nlist.shape
    order = kept_per_types(  # the same for every step of a system
        "pair order",
        (one_side, ntypes, nf, natoms),
        atype,
        lambda: _group_order(one_side, ntypes, nf, natoms, atype),
    )
    nl = nlist.reshape(nf * natoms, nnei)
    vectors = diff.reshape(nf * natoms, nnei, 3)
    if not order.identity:
        nl = nl.index_select(0, order.centre)
        vectors = vectors.index_select(0, order.centre)
    neighbour = nl.clamp(min=0)  # + 0 in the first frame: one addition less for one frame
    if order.base is not None:
        neighbour = neighbour + order.base
    plan = PairPlan(
        order.centre, neighbour.view(-1), order.types, list(order.bounds), nf, natoms, vectors
    )
    return plan, nl


def smooth_weight_grad(r: Tensor, rcut_smth: float, rcut: float) -> Tensor:
    """d(smooth_weight)/dr ``= -30u²(1-u)²/(rcut - rcut_smth)``; 0 outside (rcut_smth, rcut)."""
    width = rcut - rcut_smth
    u = (torch.clamp(r, rcut_smth, rcut) - rcut_smth) / width
    v = u * (1.0 - u)
    return v * v * (-30.0 / width)


def switched_distance(desc, planes: Tensor, mask: Tensor):
    """Pair vectors as planes (3, M, nnei) with padded slots moved beyond rcut (so that the
    switch and its derivative are 0 there), r, r + env_protection, the switch w(r) and w'(r)
    (M, nnei) each."""
    keep = mask.to(planes.dtype)  # d·1 + 0 where real, d·0 + 2rcut where padded
    far = torch.addcmul((1.0 - keep).mul_(2.0 * desc.rcut), planes, keep)
    # |d| by two multiply-adds: vector_norm over the planes' first dimension takes 40 times as
    # long, and over the last dimension of (…, 3) rows 3 times
    r = torch.addcmul(torch.addcmul(far[0] * far[0], far[1], far[1]), far[2], far[2]).sqrt_()
    rp = r + desc.env_protection
    w = smooth_weight(r, desc.rcut_smth, desc.rcut)
    dw = smooth_weight_grad(r, desc.rcut_smth, desc.rcut)
    return far, r, rp, w, dw


def as_planes(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """(…, M, nnei, c) -> (…, c, M, nnei) contiguous, in ``dtype``: the layout the pull-backs
    compute in (on (…, c) rows, every operation that broadcasts a (…, 1) factor over the c
    components runs an inner loop of c elements, 10–30 times slower than on planes)."""
    lead = x.dim() - 3
    order = (*range(lead), lead + 2, lead, lead + 1)
    shape = [x.shape[i] for i in order]
    return torch.empty(shape, dtype=dtype or x.dtype, device=x.device).copy_(x.permute(order))


def as_rows(x: Tensor) -> Tensor:
    """The inverse of ``as_planes``: (…, c, M, nnei) -> (…, M, nnei, c) contiguous."""
    lead = x.dim() - 3
    return x.permute(*range(lead), lead + 1, lead + 2, lead).contiguous()


class _EnvironmentMatrix(torch.autograd.Function):
    """Normalised rows (M, nnei, width) of pair vectors (M, nnei, 3); its backward is
    ``kind.pull`` of the rows' cotangent times the scale. Also returns, without gradient,
    the far pair vectors (3, M, nnei), the coefficients (·, M, nnei) and the scale ``1/dstd``
    (M, nnei, width; 0 for excluded pairs)."""

    @staticmethod
    def forward(ctx, diff: Tensor, mask: Tensor, types: Tensor, keep, desc, kind: RowKind):
        far, r, rp, w, dw = switched_distance(desc, as_planes(diff, desc.dtype), mask)
        raw, coef = kind.raw(far, r, rp, w, dw)
        davg, dstd = desc.davg.to(desc.dtype), desc.dstd.to(desc.dtype)
        rows = (raw - davg.index_select(0, types)) / dstd.index_select(0, types)
        scale = (1.0 / dstd).index_select(0, types)
        if keep is not None:
            keep = keep.unsqueeze(-1).to(rows.dtype)
            rows = rows * keep
            scale = scale * keep
        ctx.kind, ctx.dtype = kind, diff.dtype
        ctx.mark_non_differentiable(far, coef, scale)
        ctx.save_for_backward(far, coef, scale)
        return rows, far, coef, scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, rows_bar: Tensor | None, *_):
        if rows_bar is None:
            return None, None, None, None, None, None
        far, coef, scale = ctx.saved_tensors
        g = ctx.kind.pull(as_planes(rows_bar * scale), far, coef)
        return as_rows(g).to(ctx.dtype), None, None, None, None, None


def environment_matrix(
    desc, kind: RowKind, diff: Tensor, nl: Tensor, types: Tensor, atype: Tensor
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """Rows, far pair vectors, coefficients and scale of pair vectors ``diff`` (M, nnei, 3)
    with lists ``nl`` (M, nnei) and centre types ``types`` (M,) in any order (``atype``: the
    frame's atom types), and the mask of real neighbours."""
    mask = nl >= 0
    keep = None
    if desc.has_exclusions:
        ntype_j = torch.where(mask, atype[nl.clamp(min=0)], desc.ntypes)
        keep = desc.pair_keep[types.unsqueeze(-1), ntype_j]
    return _EnvironmentMatrix.apply(diff, mask, types, keep, desc, kind), mask


def slot_widths(desc, mask: Tensor, bounds: list[int]) -> list[list[int]]:
    """Per group and neighbour type: the slots up to the last real neighbour of any row
    (one synchronisation for all of them)."""
    col = torch.arange(desc.nnei, device=mask.device)
    kind = torch.zeros_like(col)  # each slot's neighbour type
    start = torch.zeros_like(col)  # the first slot of its type's block
    for t in range(1, desc.ntypes):
        past = (col >= desc.offsets[t]).to(col.dtype)
        kind = kind + past
        start = start + past * desc.sel[t - 1]
    pos_t = col + 1 - start  # 1-based position in the block
    used = torch.stack([mask[a:b].any(dim=0) for a, b in zip(bounds[:-1], bounds[1:])])
    last = used * pos_t
    index = kind.expand_as(last)
    widths = last.new_zeros(len(bounds) - 1, desc.ntypes).scatter_reduce_(1, index, last, "amax")
    return widths.tolist()
