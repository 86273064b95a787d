"""The embedding contraction and its row gradients on the compiled kernels (the "kernels"
backend's embedding): the same two autograd nodes as ``embedding_nodes``, with their work done
by ``kernels.Kernels`` on blocks of centres sorted by how many slots they need (``BlockPlan``),
so that few padded slots are evaluated. ``tests/model/test_kernels.py`` compares them with the
PyTorch nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from mdtrain.model.accel.embedding_nodes import EmbeddedBlock, Tape, padded_tail
from mdtrain.model.accel.kernels import Kernels
from mdtrain.model.accel.layout import dense, layer_layout, layer_params
from mdtrain.model.gather import take_pairs
from mdtrain.model.network import EmbeddingNet

BLOCK_ROWS = 512  # 256–1024 alike on the water step; 4096 was 12 % slower


class BlockPlan(NamedTuple):
    """How the kernels cut one embedding call into blocks of centres (int64 tensors).

    Block b holds the centres ``order[start[b] : start[b + 1]]`` and evaluates the first
    ``width[b]`` slots of each, as tape rows from ``row0[b]``; ``widths`` (B,) is each centre's
    evaluated width in the original order; ``row0[-1]`` is the number of tape rows.
    """

    order: Tensor
    start: Tensor
    width: Tensor
    row0: Tensor
    widths: Tensor

    @property
    def rows(self) -> int:
        return int(self.row0[-1])


def centres_per_block(nc: int, n: int) -> int:
    """Centres per block: about ``BLOCK_ROWS`` rows, and a whole number of blocks per thread
    (the threads take blocks in turn)."""
    threads = torch.get_num_threads()
    rounds = max(1, round(nc * max(n, 1) / (BLOCK_ROWS * threads)))
    return max(1, -(-nc // (rounds * threads)))


def plan_blocks(used: Tensor | None, nc: int, n: int) -> BlockPlan:
    """Blocks of about ``BLOCK_ROWS`` rows over ``nc`` centres with ``n`` slot columns.

    ``used`` (B,): the slots each centre needs (one past its last real neighbour). Centres are
    then sorted by it, so that a block's width, its largest ``used``, wastes few rows on padding
    (about 10 % fewer rows than the rectangle on water). None: every centre evaluates all n.
    """
    # in numpy: a dozen operations on a few hundred integers, each a tenth of torch's call cost
    per = centres_per_block(nc, n)
    start = np.append(np.arange(0, nc, per, dtype=np.int64), np.int64(nc))
    if used is None:
        order = np.arange(nc, dtype=np.int64)
        width = np.full(len(start) - 1, n, dtype=np.int64)
    else:
        counts = used.to(device="cpu", dtype=torch.int64).numpy()
        order = np.argsort(-counts, kind="stable")  # descending, ties in centre order
        width = counts[order][start[:-1]]
    sizes = np.diff(start)
    row0 = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(sizes * width)])
    widths = np.empty(nc, dtype=np.int64)
    widths[order] = np.repeat(width, sizes)
    parts = (order, start, width, row0, widths)
    return BlockPlan(*(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in parts))


def padded_share(rows: Tensor, g: Tensor, first: Tensor, types: Tensor | None) -> Tensor:
    """Σ R̃ᵀG over each row's padded columns (B, 4, M), given the padded rows (types, cols,
    4) of the columns from the first one any row needs, G of them, and each row's first
    column ``first`` (B,) among them: per centre type, the terms summed from the right.
    In PyTorch operations: the reference whose bits ``_PaddedShare`` reproduces (tests)."""
    terms = rows.unsqueeze(-1) * g.view(rows.shape[0], rows.shape[1], 1, -1)
    suffix = torch.cat([terms.flip(1).cumsum(1).flip(1), torch.zeros_like(terms[:, :1])], 1)
    kind = types if types is not None else torch.zeros_like(first)
    return take_pairs(suffix, kind, first.to(kind.device))


class _PaddedShare(torch.autograd.Function):
    """``padded_share`` as one node on the kernels: its sums and gather in one compiled call,
    its backward's gather-add and prefix sums in another, with the roundings of the PyTorch
    operations (each partial sum as torch's cumsum makes it); the products' cotangent back to
    G (and to the rows, if they need one) by the same PyTorch operations as autograd's.
    About a tenth of the time of the dozen small operations and their nodes it replaces."""

    @staticmethod
    def forward(ctx, rows: Tensor, g: Tensor, first: Tensor, kind: Tensor, kernels: Kernels):
        rows = rows.contiguous()
        first, kind = first.to(torch.int64).contiguous(), kind.to(torch.int64).contiguous()
        ctx.kernels, ctx.first, ctx.kind = kernels, first, kind
        ctx.save_for_backward(rows, g)
        return kernels.padded_share(rows, g.contiguous(), first, kind)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        rows, g = ctx.saved_tensors
        terms = ctx.kernels.padded_share_terms(grad.contiguous(), ctx.first, ctx.kind, rows)
        grad_g = grad_rows = None
        if ctx.needs_input_grad[1]:  # MulBackward0's, then sum_to's reduction of the broadcast
            grad_g = (terms * rows.unsqueeze(-1)).sum(2, keepdim=True).view(g.shape)
        if ctx.needs_input_grad[0]:
            gv = g.view(rows.shape[0], rows.shape[1], 1, -1)
            grad_rows = (terms * gv).sum(3, keepdim=True).view(rows.shape)
        return grad_rows, grad_g, None, None, None


class KernelEmbedding:
    """The embedding contraction and its row gradients on the compiled kernels (CPU tensors,
    float32 or float64)."""

    name = "kernels"

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels

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
        """As ``TorchEmbedding.contract``; ``mask`` (B, w) marks real neighbours, so that each
        row evaluates only up to its own last one and its padded columns are added from
        ``pad`` per centre type. ``memo`` keeps the block plan of these rows for the next net
        on the same rows."""
        if rows.device.type != "cpu":
            raise RuntimeError(
                "the compiled kernels take CPU tensors: build the model for its device"
            )
        if n == 0:
            if rows.shape[2] > 0:
                tmat = tmat + padded_tail(pad, net(pad[:, :, 0].reshape(-1, 1)), types)
            return tmat, None
        plan = memo.get(lo) if memo is not None else None
        if plan is None:  # the same for every net on these rows (a committee's members)
            col = torch.arange(1, n + 1, device=mask.device)
            used = (mask[:, :n] * col).amax(dim=1)
            plan = plan_blocks(used, rows.shape[0], n)
            if memo is not None:
                memo[lo] = plan
        t_k, value, slope = _KernelEmbedContract.apply(
            rows[:, :, :n], self.kernels, plan, layer_layout(net.layers), *layer_params(net.layers)
        )
        tmat = tmat + t_k
        first = plan.widths
        start = int(first.min())
        if start < rows.shape[2]:
            tail = pad[:, start:]
            g = net(tail[:, :, 0].reshape(-1, 1))
            kind = types if types is not None else torch.zeros_like(first)
            share = _PaddedShare.apply(tail, g, first - start, kind, self.kernels)
            tmat = tmat + share
        return tmat, EmbeddedBlock(value, slope, group, lo, n, plan)

    def row_grads(
        self, tbar: Tensor, blocks: list[EmbeddedBlock], rows: Tensor, width: int
    ) -> Tensor:
        """dE/dR̃ (B, nnei, ``width``) of a group's rows (B, nnei, A), every block's columns
        written into one tensor; 0 on the slots no block evaluates."""
        spans = tuple((block.lo, block.n, block.plan) for block in blocks)
        tapes = [t for block in blocks for t in (block.value, block.slope)]
        return _KernelRowGrads.apply(tbar, rows, self.kernels, spans, width, *tapes)

    def __deepcopy__(self, memo):  # holds the loaded library: copies of a model share it
        return self


class _KernelEmbedContract(torch.autograd.Function):
    """``_EmbedContract`` on the kernels, over the plan's blocks: G and dG/ds come out as
    (tape rows, M) in the plan's order, and T lacks the share of the slots not evaluated."""

    @staticmethod
    def forward(ctx, rows: Tensor, kernels: Kernels, plan: BlockPlan, layout: tuple, *params):
        s = rows.new_empty(plan.rows, 1)
        tape = Tape(s, layout, params, inner=False)
        tmat = rows.new_empty(rows.shape[0], rows.shape[1], tape.value.shape[1])
        kernels.embed_forward(rows, layout, params, tape, plan, tmat)
        ctx.kernels, ctx.plan, ctx.layout = kernels, plan, layout
        ctx.row_grad = None
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(rows, s, *params, *tape.saved_tensors())
        return tmat, tape.value, tape.slope

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, tbar_t: Tensor | None, gv: Tensor | None, gs: Tensor | None):
        rows, s, *rest = ctx.saved_tensors
        nparams = sum(3 if has_idt else 2 for _, _, has_idt in ctx.layout)
        tape = Tape(s, ctx.layout, tuple(rest[:nparams]), tuple(rest[nparams:]))
        grads = tape.new_grads()
        row_grad, ctx.row_grad = ctx.row_grad, None
        z, tbar = (None, None) if row_grad is None else row_grad
        cotangents = [dense(c) for c in (tbar_t, gv, gs, z, tbar)]
        ctx.kernels.embed_backward(rows, ctx.layout, tape.params, tape, ctx.plan, cotangents, grads)
        return (None, None, None, None, *grads)


class _KernelRowGrads(torch.autograd.Function):
    """``_RowGrad`` on the kernels for all the blocks of a group of rows (B, nnei, A) at once:
    each block (``spans``: its first column, columns, plan; ``tapes``: its G and dG/ds) writes
    its columns and zeros up to the next block's into one (B, nnei, W) tensor, so that no zero
    pieces are made and concatenated. Its backward sums the blocks' T̄ parts (in the order
    autograd summed them when each block was a node of its own: the last block's first) and
    hands each block's (Z, T̄) to the ``_KernelEmbedContract`` node that made its G and dG/ds."""

    @staticmethod
    def forward(ctx, tbar, rows, kernels: Kernels, spans: tuple, width: int, *tapes) -> Tensor:
        tbar = tbar.contiguous()
        nc, nnei = rows.shape[:2]
        out = tbar.new_empty(nc, nnei, width)
        starts = [lo for lo, _, _ in spans] + [nnei]
        if starts[0] > 0:
            out[:, : starts[0]].zero_()
        for (lo, n, plan), end, k in zip(spans, starts[1:], range(0, len(tapes), 2), strict=True):
            cols = rows[:, lo : lo + n].transpose(1, 2)
            kernels.row_grad_into(tbar, tapes[k], tapes[k + 1], cols, plan, out[:, lo:end])
        ctx.kernels, ctx.spans = kernels, spans
        ctx.producers = [tapes[k].grad_fn for k in range(0, len(tapes), 2)]
        ctx.save_for_backward(tbar, rows, *tapes)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, z: Tensor):
        tbar, rows, *tapes = ctx.saved_tensors
        z = z.contiguous()
        tbar_grad = None
        for k in reversed(range(len(ctx.spans))):
            producer = ctx.producers[k]
            if producer is None or not isinstance(producer, _KernelEmbedContract._backward_cls):
                raise RuntimeError("compiled row gradients need G and dG/ds from the kernels' node")
            lo, n, plan = ctx.spans[k]
            cols = rows[:, lo : lo + n].transpose(1, 2)
            value, slope = tapes[2 * k], tapes[2 * k + 1]
            # the blocks' parts summed in the kernel: part(last) + … + part(first)
            tbar_grad = ctx.kernels.row_grad_tbar(z[:, lo:], value, slope, cols, plan, tbar_grad)
            zk = z[:, lo : lo + n]
            if zk.shape[2] < rows.shape[2]:  # the row gradient's dropped columns: no cotangent
                zk = torch.cat([zk, zk.new_zeros(*zk.shape[:2], rows.shape[2] - zk.shape[2])], 2)
            producer.row_grad = (zk.detach(), tbar.detach())  # no cycle: see embedding_nodes
        ctx.producers = []
        return tbar_grad, None, None, None, None, *([None] * len(tapes))
