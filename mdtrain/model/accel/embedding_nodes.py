"""The fused PyTorch nodes of a tanh embedding net (eager only): G, dG/ds and the contraction
T = Σ R̃ᵀG in one autograd node, and the row gradients dE/dR̃ in another that hands its gradient
back in factored form. Both directions walk blocks of rows through all layers so that a block's
intermediate tensors stay in cache (the step is memory-bound). ``TorchEmbedding`` is the "fused"
backend's embedding; ``kernel_nodes`` runs the same two nodes on the compiled kernels, reusing
the tape defined here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mdtrain.model.accel.layout import (
    add_cross_product,
    layer_layout,
    layer_params,
    skip_fold,
    tanh_grad,
)
from mdtrain.model.gather import take
from mdtrain.model.network import EmbeddingNet


class EmbeddedBlock(NamedTuple):
    """One embedding call over the leading ``n`` slot columns from ``lo`` of one group of rows
    (group: all rows with ``type_one_side``, else the rows of one centre type). ``plan`` is the
    compiled kernels' ``BlockPlan`` (None for the PyTorch nodes)."""

    value: Tensor  # G
    slope: Tensor  # dG/ds
    group: int
    lo: int
    n: int
    plan: object | None


def padded_tail(rows: Tensor, g: Tensor, types: Tensor | None) -> Tensor:
    """Σ R̃ᵀG over columns that are padding for every row: one value per centre type of
    ``rows`` (types, cols, 4), broadcast to the rows (``types``) or (1, 4, M) for one centre;
    ``g`` is G of ``rows`` flattened."""
    tail = torch.matmul(rows.transpose(1, 2), g.view(rows.shape[0], rows.shape[1], -1))
    return take(tail, types) if types is not None else tail


class TorchEmbedding:
    """The embedding contraction and its row gradients as the fused PyTorch nodes."""

    name = "fused"

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
        """``tmat`` plus Σ R̃ᵀG over one block of slot columns from ``lo``: rows (B, 4, w) of
        which the first ``n`` hold a real neighbour for some row (``mask`` (B, w)); the other
        columns are padding for every row, so their share is computed once per centre type
        (``types`` (B,), or None for one centre) from the padded rows ``pad`` (types, w, 4).
        ``memo``: what an implementation keeps for the next net on the same rows (unused
        here)."""
        block = None
        if n > 0:
            t_k, value, slope = _EmbedContract.apply(
                rows[:, :, :n], layer_layout(net.layers), *layer_params(net.layers)
            )
            tmat = tmat + t_k
            block = EmbeddedBlock(value, slope, group, lo, n, None)
        if n < rows.shape[2]:
            tail = pad[:, n:]
            tmat = tmat + padded_tail(tail, net(tail[:, :, 0].reshape(-1, 1)), types)
        return tmat, block

    def row_grads(
        self, tbar: Tensor, blocks: list[EmbeddedBlock], rows: Tensor, width: int
    ) -> Tensor:
        """dE/dR̃ (B, nnei, ``width``) of a group's rows (B, nnei, A): each block's columns
        from ``_RowGrad``, 0 on the columns no block evaluates."""
        pieces: list[Tensor] = []
        col = 0
        for block in blocks:
            lo, n = block.lo, block.n
            if lo > col:
                pieces.append(rows.new_zeros(rows.shape[0], lo - col, width))
            cols = rows[:, lo : lo + n].transpose(1, 2)
            rbar = _RowGrad.apply(tbar, block.value, block.slope, cols)
            pieces.append(rbar if rbar.shape[2] == width else rbar[:, :, :width])
            col = lo + n
        if col < rows.shape[1]:
            pieces.append(rows.new_zeros(rows.shape[0], rows.shape[1] - col, width))
        return torch.cat(pieces, dim=1)

    def __deepcopy__(self, memo):  # stateless: copies of a model share it
        return self


class Tape:
    """Buffers of one fused evaluation of a tanh embedding net on ``rows`` inputs ``s``.

    Per layer ``a = xW + b, t = tanh(a), y = t·idt + skip(x)`` and the tangent ``da = dx W,
    dt = da(1 − t²), dy = dt·idt + skip(dx)`` (dx = 1 at the input). The backward takes
    ``(ȳ, dȳ)`` to ``dā = dȳ·idt(1 − t²)``, ``ā = (ȳ·idt − 2t·da·dȳ·idt)(1 − t²)``,
    ``W̄ = xᵀā + dxᵀdā``, ``b̄ = Σā``, ``x̄ = āWᵀ + fold(ȳ)``, ``dx̄ = dāWᵀ + fold(dȳ)``.
    Both directions run over blocks of rows through all layers (``forward_rows``,
    ``backward_rows``), so that a block's intermediate tensors stay in cache between the
    operations on them (the step is memory-bound); only what the backward needs (t, da and
    the layer outputs) is kept for all rows. ``inner=False`` leaves out the outputs y and dy of
    the layers before the last (None): the compiled kernels write them to scratch in the
    forward and repeat those elementwise steps in the backward, which costs less than storing
    them and reading them back.
    """

    block_bytes = 1 << 21  # one (rows, widest layer) block; the fastest of 0.5–8 MiB measured
    min_block_rows = 256

    def __init__(
        self, s: Tensor, layout: tuple, params: tuple, saved: tuple = (), inner: bool = True
    ) -> None:
        self.s, self.layout, self.params = s, layout, params
        self.specs: list[tuple[int, int, int, bool]] = []
        k = 0
        for n_in, skip, has_idt in layout:
            self.specs.append((k, n_in, skip, has_idt))
            k += 3 if has_idt else 2
        width = max(int(p.shape[-1]) for p in params)
        self.block = max(self.min_block_rows, self.block_bytes // (width * s.element_size()))
        n = len(layout)
        if saved:  # rebuilt in the backward from ``saved_tensors()``
            self.outs, self.douts = list(saved[:n]), list(saved[n : 2 * n])
            self.ts, self.das = list(saved[2 * n : 3 * n]), [None, *saved[3 * n : 4 * n - 1]]
            return
        rows, opts = s.shape[0], {"dtype": s.dtype, "device": s.device}
        self.outs, self.douts, self.ts, self.das = [], [], [], []
        for layer, (k, _, skip, has_idt) in enumerate(self.specs):
            n_out = params[k].shape[1]
            t = torch.empty(rows, n_out, **opts)
            self.ts.append(t)
            # y = t needs no copy; the first layer's da is W itself (dx = 1)
            plain = skip == 0 and not has_idt
            kept = inner or layer == len(self.specs) - 1
            self.outs.append(t if plain else torch.empty(rows, n_out, **opts) if kept else None)
            self.douts.append(torch.empty(rows, n_out, **opts) if kept else None)
            self.das.append(None if layer == 0 else torch.empty(rows, n_out, **opts))

    def saved_tensors(self) -> list[Tensor]:
        return [*self.outs, *self.douts, *self.ts, *self.das[1:]]

    @property
    def value(self) -> Tensor:
        return self.outs[-1]

    @property
    def slope(self) -> Tensor:
        return self.douts[-1]

    def forward_rows(self, lo: int, hi: int) -> None:
        x, dx = self.s[lo:hi], None
        for layer, (k, n_in, skip, has_idt) in enumerate(self.specs):
            w, b = self.params[k], self.params[k + 1]
            t, y, dy = self.ts[layer][lo:hi], self.outs[layer][lo:hi], self.douts[layer][lo:hi]
            # t = tanh(a) = 2·sigmoid(2a) − 1: torch's sigmoid is several times cheaper than
            # its tanh on CPU; the difference is a few units in the last place of t.
            if n_in == 1:
                torch.addcmul(b, x, w, value=2.0, out=t).add_(b)
            else:
                torch.addmm(b, x, w, beta=2.0, alpha=2.0, out=t)
            if dx is None:
                da = w.expand(hi - lo, w.shape[1])
            else:
                da = self.das[layer][lo:hi]
                torch.mul(dx, w, out=da) if n_in == 1 else torch.mm(dx, w, out=da)
            t.sigmoid_().mul_(2.0).sub_(1.0)
            torch.ops.aten.tanh_backward.grad_input(da, t, grad_input=dy)
            if has_idt:
                idt = self.params[k + 2]
                torch.mul(t, idt, out=y)
                dy.mul_(idt)
            if skip == 1:
                y.add_(x) if has_idt else torch.add(t, x, out=y)
                dy.add_(1.0 if dx is None else dx)
            elif skip == 2:
                xs, yv = x.unsqueeze(1), y.view(-1, 2, n_in)
                yv.add_(xs) if has_idt else torch.add(t.view(-1, 2, n_in), xs, out=yv)
                if dx is None:
                    dy.add_(1.0)
                else:
                    dy.view(-1, 2, n_in).add_(dx.unsqueeze(1))
            x, dx = y, dy

    def new_grads(self) -> list[Tensor]:
        return [torch.zeros_like(p) for p in self.params]

    def backward_rows(
        self, lo: int, hi: int, gy: Tensor, gdy: Tensor, grads: list[Tensor]
    ) -> Tensor:
        """Accumulate the parameter gradients of rows ``lo:hi`` given (ȳ, dȳ) of the last
        layer on those rows; returns the gradient w.r.t. their inputs s."""
        for layer in range(len(self.specs) - 1, -1, -1):
            k, n_in, skip, has_idt = self.specs[layer]
            w, t = self.params[k], self.ts[layer][lo:hi]
            x = self.s[lo:hi] if layer == 0 else self.outs[layer - 1][lo:hi]
            dx = None if layer == 0 else self.douts[layer - 1][lo:hi]
            da = w.expand(hi - lo, w.shape[1]) if layer == 0 else self.das[layer][lo:hi]
            q, dq = gy, gdy
            if has_idt:
                idt = self.params[k + 2]
                grads[k + 2] += (gy * t).sum(dim=0) + (gdy * tanh_grad(da, t)).sum(dim=0)
                q, dq = gy * idt, gdy * idt
            dabar = tanh_grad(dq, t)
            abar = torch.addcmul(q, t, da * dq, value=-2.0)
            torch.ops.aten.tanh_backward.grad_input(abar, t, grad_input=abar)
            add_cross_product(grads[k], x, abar)
            if dx is None:
                grads[k] += dabar.sum(dim=0, keepdim=True)
            else:
                add_cross_product(grads[k], dx, dabar)
            grads[k + 1] += abar.sum(dim=0)
            wt = w.t()
            fold = skip_fold(gy, skip, n_in)
            gx = torch.mm(abar, wt) if fold is None else torch.addmm(fold, abar, wt)
            if layer > 0:
                dfold = skip_fold(gdy, skip, n_in)
                gdy = torch.mm(dabar, wt) if dfold is None else torch.addmm(dfold, dabar, wt)
            gy = gx
        return gy


class _EmbedContract(torch.autograd.Function):
    """``T = Σ_j R̃_jᵀ G(s_j)`` (B, A, M) for rows ``R̃`` (B, A, n) with ``s = R̃[:, 0]`` (A = 4
    for se_e2_a, 2 for se_e2_r's ``[s, 1]``); also
    returns G and dG/ds (B, n, M) for ``_RowGrad``. Blocks of centres run the embedding net
    and the contraction while their rows are in cache.

    In the backward, the gradient reaching G and dG/ds through ``_RowGrad`` arrives in
    factored form (``Z``, ``T̄``, left on this node by ``_RowGrad.backward``), so that the
    dense (rows, M) gradients of G and dG/ds exist only block by block:
    ``Ḡ = R̃ T̄_T + Z T̄`` and ``dḠ = (Z₀R̃) T̄``. ``R̃`` never gets a gradient (the
    explicit path differentiates w.r.t. parameters only).
    """

    @staticmethod
    def forward(ctx, rows: Tensor, layout: tuple, *params: Tensor):
        nc, n = rows.shape[0], rows.shape[2]
        s = rows[:, 0, :].reshape(-1, 1)
        tape = Tape(s, layout, params)
        m = tape.value.shape[1]
        tmat = rows.new_empty(nc, rows.shape[1], m)
        ctx.centres = max(1, tape.block // n)
        for c0 in range(0, nc, ctx.centres):
            c1 = min(c0 + ctx.centres, nc)
            tape.forward_rows(c0 * n, c1 * n)
            g = tape.value[c0 * n : c1 * n].view(c1 - c0, n, m)
            torch.bmm(rows[c0:c1], g, out=tmat[c0:c1])
        ctx.layout = layout
        ctx.row_grad = None
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(rows, s, *params, *tape.saved_tensors())
        return tmat, tape.value.view(nc, n, m), tape.slope.view(nc, n, m)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, tbar_t: Tensor | None, gv: Tensor | None, gs: Tensor | None):
        rows, s, *rest = ctx.saved_tensors
        nparams = sum(3 if has_idt else 2 for _, _, has_idt in ctx.layout)
        tape = Tape(s, ctx.layout, tuple(rest[:nparams]), tuple(rest[nparams:]))
        grads = tape.new_grads()
        row_grad, ctx.row_grad = ctx.row_grad, None
        nc, n = rows.shape[0], rows.shape[2]
        m = tape.value.shape[1]
        per = ctx.centres
        rows_t = rows.transpose(1, 2)  # (B, n, 4)
        for c0 in range(0, nc, per):
            c1 = min(c0 + per, nc)
            shape = (c1 - c0, n, m)
            gy = (
                rows.new_zeros(shape) if tbar_t is None else torch.bmm(rows_t[c0:c1], tbar_t[c0:c1])
            )
            if gv is not None:
                gy += gv[c0:c1]
            if row_grad is not None:
                z, zr, tbar = row_grad
                gy.baddbmm_(z[c0:c1], tbar[c0:c1])
                gdy = torch.bmm(zr[c0:c1], tbar[c0:c1])
            else:
                gdy = rows.new_zeros(shape)
            if gs is not None:
                gdy += gs[c0:c1]
            tape.backward_rows(c0 * n, c1 * n, gy.view(-1, m), gdy.view(-1, m), grads)
        return (None, None, *grads)


class _RowGrad(torch.autograd.Function):
    """dE/dR̃ (B, n, A) of one block of slot columns from T̄ = dE/dT (B, A, M):
    ``G T̄ᵀ + [R̃·(G' T̄ᵀ), 0, 0, 0]`` with G, G' from ``_EmbedContract`` (its outputs)."""

    @staticmethod
    def forward(ctx, tbar: Tensor, value: Tensor, slope: Tensor, rows: Tensor) -> Tensor:
        tbar_t = tbar.transpose(1, 2)
        rbar = torch.bmm(value, tbar_t)
        sbar = (torch.bmm(slope, tbar_t) * rows.transpose(1, 2)).sum(dim=-1)
        rbar[:, :, 0] += sbar
        ctx.producer = value.grad_fn
        ctx.save_for_backward(tbar, value, slope, rows)
        return rbar

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, z: Tensor):
        tbar, value, slope, rows = ctx.saved_tensors
        producer = ctx.producer
        zr = rows.transpose(1, 2) * z[:, :, :1]  # (B, n, 4)
        tbar_grad = torch.bmm(z.transpose(1, 2), value).baddbmm_(zr.transpose(1, 2), slope)
        if producer is not None and isinstance(producer, _EmbedContract._backward_cls):
            # detached: the node keeps them until its own backward, and a graph-carrying tbar
            # would tie it into a cycle autograd's nodes hide from Python's collector (after
            # an out-of-memory error between the two backwards, the whole tape would leak)
            producer.row_grad = (z.detach(), zr.detach(), tbar.detach())
            return tbar_grad, None, None, None
        gv = torch.bmm(z, tbar)
        gs = torch.bmm(zr, tbar)
        return tbar_grad, gv, gs, None
