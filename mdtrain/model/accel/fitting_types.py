"""A fitting with one net per atom type as ONE autograd node on all atoms: the atomic energies
and dE/dD of a frame batch, in atom order, from the descriptor in atom order.

The rows are gathered by type once (each type's rows contiguous, frame-major as
``index_select`` per type gives them); each product runs per type into its slice of one
array, and every elementwise step (tanh, its derivatives, the idt scales, the skips) runs
once on all rows: half the calls of a node per type on a two-type model, and arrays of all
atoms, which at two threads are past ATen's parallel grain (32768 elements) where each
type's alone is not. Energies and dE/dD are scattered back once; the backward gathers the
cotangents once and scatters dL/dD once, where a node per type needed a zero array per type
and their sum. The bits are those of a ``fitting_node._ValueAndInputGrad`` per type: the
same products on the same rows, the same elementwise operations, the same order of
accumulation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mdtrain.model.accel.fitting_sweep import (
    Gradients,
    flat,
    offsets,
    reverse,
    shaped,
    split,
    sweep,
    unflat,
)
from mdtrain.model.accel.layout import Layout
from mdtrain.model.accel.per_types import kept_per_types

# Each type's block starts at a row that is a multiple of this: 64 bytes into the array for
# any width in float32 and float64, as a tensor of its own would be. MKL's products can round
# differently on operands that are not so aligned.
ALIGN_ROWS = 16


class TypeRows(NamedTuple):
    """The by-type order of the rows: ``index``, where each row comes from (frame·N + atom;
    0 in the padding between blocks); each type's real rows ``bounds`` and its block with the
    padding after it, ``spans``; ``inverse``, each atom's row, where every atom of every frame
    is in some type, else ``atoms`` and ``positions``, the real rows' atoms and rows;
    ``ordered``: the rows are the atoms in their own order (one frame, or one type, its atoms
    sorted by type, no padding), so that no gather or scatter is needed."""

    index: Tensor
    bounds: list[tuple[int, int]]
    spans: list[tuple[int, int]]
    inverse: Tensor | None
    atoms: Tensor
    positions: Tensor
    nf: int
    natoms: int
    ordered: bool


def type_rows(atype: Tensor, ntypes: int, nf: int) -> TypeRows:
    """The rows of types 0..ntypes−1 for ``nf`` frames of the atom types ``atype`` (N,)."""
    natoms = atype.shape[0]
    groups = [torch.nonzero(atype == c).view(-1) for c in range(ntypes)]
    if nf > 1:
        frames = torch.arange(nf, device=atype.device).mul_(natoms).view(-1, 1)
        groups = [(frames + idx).view(-1) for idx in groups]
    bounds, parts, start = [], [], 0
    for c, idx in enumerate(groups):
        bounds.append((start, start + len(idx)))
        start += len(idx)
        parts.append(idx)
        pad = -start % ALIGN_ROWS if c < ntypes - 1 else 0
        if pad:
            parts.append(idx.new_zeros(pad))
            start += pad
    spans = [(s, nxt) for (s, _), (nxt, _) in zip(bounds, [*bounds[1:], (start, 0)], strict=True)]
    atoms = torch.cat(groups)
    padded = len(atoms) < start
    index = torch.cat(parts) if padded else atoms
    device = atype.device
    positions = (
        torch.cat([torch.arange(s, e, device=device) for s, e in bounds]) if padded else None
    )
    inverse, ordered = None, False
    if len(atoms) == nf * natoms:  # every atom has a net
        every = torch.arange(len(atoms), device=device)
        rows = positions if padded else every
        inverse = torch.empty_like(atoms).index_copy_(0, atoms, rows)
        ordered = not padded and torch.equal(atoms, every)
    return TypeRows(index, bounds, spans, inverse, atoms, positions, nf, natoms, ordered)


def cached_type_rows(atype: Tensor, ntypes: int, nf: int) -> TypeRows:
    """`type_rows`, kept per atom types and frame count (`per_types.kept_per_types`)."""
    return kept_per_types("type rows", (ntypes, nf), atype, lambda: type_rows(atype, ntypes, nf))


class TypeNets:
    """The products of one net per type, each on its type's rows, written into one array
    (``fitting_sweep``'s ``ops``). ``cache``: the per-row idt and output weights and the
    transposed weights, built in the forward, reused by the backward."""

    def __init__(self, layout: Layout, params, rows: TypeRows, cache=None) -> None:
        self.offsets = offsets(layout)
        per_net = self.offsets[-1]
        self.nets = [split(layout, params[i : i + per_net]) for i in range(0, len(params), per_net)]
        self.starts = range(0, len(params), per_net)  # each net's first parameter
        self.bounds = rows.bounds
        self.spans = rows.spans  # with the padding rows after each block
        self.grads = Gradients(len(params))
        self.cache: dict = {} if cache is None else cache

    def idt(self, k: int) -> Tensor:
        """Layer ``k``'s idt on every row (each type's)."""
        rows = self.cache.get(k)
        if rows is None:
            rows = torch.cat([n[k][2].expand(e - s, -1) for (s, e), n in self._spans()])
            self.cache[k] = rows
        return rows

    def output_rows(self, x: Tensor) -> Tensor:
        """Each type's ``wᵀ`` of the output layer on its rows."""
        rows = self.cache.get("out")
        if rows is None:
            rows = torch.cat([n[-1][0].t().expand(e - s, -1) for (s, e), n in self._spans()])
            self.cache["out"] = rows
        return rows

    def _transposed(self, k: int) -> list[Tensor]:
        found = self.cache.get(("t", k))
        if found is None:
            found = [net[k][0].t() for net in self.nets]
            self.cache[("t", k)] = found
        return found

    def _each(self):
        return zip(self.bounds, self.nets, strict=True)

    def _spans(self):
        return zip(self.spans, self.nets, strict=True)

    def affine(self, k: int, x: Tensor) -> Tensor:
        out = x.new_empty(x.shape[0], self.nets[0][k][0].shape[1])
        for (s, e), net in self._each():
            w, b = net[k][:2]
            torch.addmm(b, x[s:e], w, out=out[s:e])
        return out

    def times_wt(self, k: int, p: Tensor, fold: Tensor | None) -> Tensor:
        """``p Wᵀ (+ fold)``, each type with its W."""
        out = p.new_empty(p.shape[0], self.nets[0][k][0].shape[0])
        for (s, e), wt in zip(self.bounds, self._transposed(k), strict=True):
            if fold is None:
                torch.mm(p[s:e], wt, out=out[s:e])
            else:
                torch.addmm(fold[s:e], p[s:e], wt, out=out[s:e])
        return out

    def sweep_back(self, k: int, g: Tensor, p: Tensor) -> Tensor:
        """``g W``, and ``W̄ += gᵀ p``, each type with its W."""
        out = g.new_empty(g.shape[0], self.nets[0][k][0].shape[1])
        for (s, e), net, first in zip(self.bounds, self.nets, self.starts, strict=True):
            g_c = g[s:e]
            self.grads.add_product(first + self.offsets[k], g_c, p[s:e])
            torch.mm(g_c, net[k][0], out=out[s:e])
        return out

    def layer_back(
        self, k: int, x: Tensor, a_bar: Tensor, fold: Tensor | None, onward: bool
    ) -> Tensor | None:
        """``W̄ += xᵀ ā``, ``b̄ += Σ ā``, and (if ``onward``) ``ā Wᵀ (+ fold)``, each type
        with its W."""
        out = a_bar.new_empty(a_bar.shape[0], self.nets[0][k][0].shape[0]) if onward else None
        i = self.offsets[k]
        parts = zip(self.bounds, self.starts, self._transposed(k), strict=True)
        for (s, e), first, wt in parts:
            a_c = a_bar[s:e]
            self.grads.add_product(first + i, x[s:e], a_c)
            self.grads.add(first + i + 1, a_c.sum(dim=0))
            if out is None:
                continue
            if fold is None:
                torch.mm(a_c, wt, out=out[s:e])
            else:
                torch.addmm(fold[s:e], a_c, wt, out=out[s:e])
        return out

    def add_weight_grad(self, k: int, left: Tensor, right: Tensor) -> None:
        for (s, e), first in zip(self.bounds, self.starts, strict=True):
            self.grads.add_product(first + self.offsets[k], left[s:e], right[s:e])

    def add_rowsum(self, k: int, j: int, a: Tensor) -> None:
        for (s, e), net, first in zip(self.bounds, self.nets, self.starts, strict=True):
            self.grads.add(first + self.offsets[k] + j, shaped(a[s:e].sum(dim=0), net[k][j]))


def _gathered(values: Tensor, rows: TypeRows) -> Tensor:
    """Rows (nf·N, ...) in (frame, atom) order taken in the by-type order. Where that is
    their own order, ``values`` themselves if contiguous and 64-byte aligned, as a gathered
    copy is (MKL's products can round differently on other operands)."""
    if rows.ordered and values.is_contiguous() and values.data_ptr() % 64 == 0:
        return values
    return values.index_select(0, rows.index)


def _scattered(values: Tensor, rows: TypeRows) -> Tensor:
    """Rows in the by-type order put back in (frame, atom) order; zero for atoms of no type."""
    if rows.ordered:
        return values
    if rows.inverse is not None:
        return values.index_select(0, rows.inverse)
    real = values if rows.positions is None else values.index_select(0, rows.positions)
    out = values.new_zeros((rows.nf * rows.natoms, *values.shape[1:]))
    return out.index_copy_(0, rows.atoms, real)


class TypesValueAndInputGrad(torch.autograd.Function):
    """Atomic energies (nf, N) float64 and dE/dD (nf, N, dim) from D (nf, N, dim), the
    parameters being each type's net's ``layer_params`` in turn."""

    @staticmethod
    def forward(
        ctx, descriptor: Tensor, rows: TypeRows, layout: Layout, *params: Tensor
    ) -> tuple[Tensor, Tensor]:
        nf, natoms, dim = descriptor.shape
        x = _gathered(descriptor.reshape(-1, dim), rows)
        ops = TypeNets(layout, params, rows)
        energy, g, tape = sweep(ops, x, layout)
        ctx.rows, ctx.layout, ctx.nparams, ctx.cache = rows, layout, len(params), ops.cache
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*params, *flat(tape))
        energies = _scattered(energy.view(-1).to(torch.float64), rows).view(nf, natoms)
        return energies, _scattered(g, rows).view(nf, natoms, dim)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, energy_bar: Tensor | None, grad_bar: Tensor | None):
        rows, layout = ctx.rows, ctx.layout
        saved = ctx.saved_tensors
        params, rest = saved[: ctx.nparams], saved[ctx.nparams :]
        tape = unflat(rest, len(layout))
        ops = TypeNets(layout, params, rows, ctx.cache)
        dim = tape.inputs[0].shape[-1]
        e_bar = g_bar = None
        if energy_bar is not None:
            e_bar = _gathered(energy_bar.reshape(-1), rows)
            e_bar = e_bar.to(params[0].dtype).view(-1, 1)
        if grad_bar is not None:
            g_bar = _gathered(grad_bar.reshape(-1, dim), rows)
        need_x = ctx.needs_input_grad[0]
        x_bar = reverse(ops, layout, tape, e_bar, g_bar, need_x)
        d_bar = None
        if need_x:
            d_bar = _scattered(x_bar, rows).view(rows.nf, rows.natoms, dim)
        return (d_bar, None, None, *ops.grads.values)
