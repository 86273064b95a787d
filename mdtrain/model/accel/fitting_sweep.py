"""The arithmetic of the fitting node (``fitting_node``): a tanh net's output, its input
gradient, and the reverse of both, written once over a small set of product operations.

Per hidden layer ``k``: ``a = xW + b``, ``t = tanh(a)``, ``y = t·idt + skip(x)``; the output is
``e = x_L w + b_L``. The sweep runs ``g_L = wᵀ``, ``p = (g·idt)(1 − t²)``, ``g_k = p Wᵀ +
fold(g_(k+1))``. Its reverse (cotangent ``ḡ`` of ``g_0``) gives ``p̄ = ḡW``, ``W̄ += ḡᵀp``,
``ḡ_(k+1) = unfold(ḡ) + p̄(1 − t²)·idt``, ``idt̄ += Σ p̄(1 − t²)g``, and a contribution
``−2t·p̄·g·idt`` to ``t̄``; the reverse of the forward then runs as usual with that extra ``t̄``.

Everything that touches a weight goes through the ``ops`` object: ``DenseNets`` for one net
(rows, n) or K nets of one layout stacked (K, rows, n); ``fitting_types.TypeNets`` for one net
per atom type on rows grouped by type, whose products run per type into one array so that
every elementwise step runs once on all rows. The elementwise steps and the order in which
each gradient is accumulated are the same for both, so both give the bits of the plain
per-net node.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mdtrain.model.accel.layout import Layout, tanh_grad


class Tape(NamedTuple):
    """What the reverse needs, per hidden layer: its input, t, g_(k+1), g_(k+1)·idt (g_(k+1)
    itself without idt) and p; ``inputs`` has the output layer's input last."""

    inputs: list[Tensor]
    ts: list[Tensor]
    upper: list[Tensor]
    scaled: list[Tensor]
    slopes: list[Tensor]


def flat(tape: Tape) -> list[Tensor]:
    """The tape as one list, for ``save_for_backward``."""
    return [t for part in tape for t in part]


def unflat(saved, nlayers: int) -> Tape:
    """The reverse of `flat`."""
    n = nlayers
    inputs = list(saved[: n + 1])
    return Tape(inputs, *(list(saved[n + 1 + i * n : n + 1 + (i + 1) * n]) for i in range(4)))


def offsets(layout: Layout) -> list[int]:
    """Index of each layer's first parameter (hidden layers, then the output layer), and the
    count of one net's parameters last."""
    found = [0]
    for _, _, has_idt in layout:
        found.append(found[-1] + (3 if has_idt else 2))
    return [*found, found[-1] + 2]


def split(layout: Layout, params) -> list[tuple[Tensor, ...]]:
    """Per layer (hidden ones, then the output layer): (W, b) or (W, b, idt)."""
    marks = offsets(layout)
    return [tuple(params[a:b]) for a, b in zip(marks[:-1], marks[1:], strict=True)]


def fold(grad: Tensor, skip: int, n_in: int) -> Tensor | None:
    """Gradient reaching a layer's input through its skip connection."""
    if skip == 1:
        return grad
    if skip == 2:
        return torch.add(grad[..., :n_in], grad[..., n_in:])
    return None


def unfold(grad: Tensor, skip: int) -> Tensor | None:
    """The reverse of `fold`: a cotangent of the input side, carried to the output side."""
    if skip == 1:
        return grad
    if skip == 2:
        return torch.cat([grad, grad], dim=-1)
    return None


def sweep(ops, x: Tensor, layout: Layout) -> tuple[Tensor, Tensor, Tape]:
    """The net's output, its input gradient, and the tape for `reverse`."""
    inputs, ts = [x], []
    for k, (n_in, skip, has_idt) in enumerate(layout):
        t = ops.affine(k, x).tanh_()
        if skip == 1:
            y = torch.mul(t, ops.idt(k)).add_(x) if has_idt else t + x
        else:
            y = t * ops.idt(k) if has_idt else t
            if skip == 2:
                lead = x.shape[:-1]
                y = (y.view(*lead, 2, n_in) + x.unsqueeze(-2)).view(*lead, 2 * n_in)
        ts.append(t)
        x = y
        inputs.append(x)
    energy = ops.affine(len(layout), x)
    g = ops.output_rows(x)
    upper, scaled, slopes = [], [], []
    for k in range(len(layout) - 1, -1, -1):
        n_in, skip, has_idt = layout[k]
        gs = g * ops.idt(k) if has_idt else g
        p = tanh_grad(gs, ts[k])
        upper.append(g)
        scaled.append(gs)
        slopes.append(p)
        g = ops.times_wt(k, p, fold(g, skip, n_in))
    for part in (upper, scaled, slopes):
        part.reverse()
    return energy, g, Tape(inputs, ts, upper, scaled, slopes)


def reverse(
    ops,
    layout: Layout,
    tape: Tape,
    energy_bar: Tensor | None,
    g_bar: Tensor | None,
    need_x: bool = True,
) -> Tensor | None:
    """The cotangent of x (None where not ``need_x``: the first layer's product with Wᵀ is
    skipped); the parameters' gradients are accumulated by ``ops``."""
    inputs, ts, upper, scaled, slopes = tape
    nlayers = len(layout)
    t_extra: list[Tensor | None] = [None] * nlayers  # −2t·p̄·g·idt, without its −2
    if g_bar is not None:  # reverse of the sweep, bottom layer first
        gb = g_bar
        for k in range(nlayers):
            _, skip, has_idt = layout[k]
            p_bar = ops.sweep_back(k, gb, slopes[k])
            r = tanh_grad(p_bar, ts[k])
            if has_idt:
                ops.add_rowsum(k, 2, r * upper[k])
                r.mul_(ops.idt(k))
            t_extra[k] = torch.mul(ts[k], p_bar).mul_(scaled[k])
            nxt = unfold(gb, skip)
            gb = r if nxt is None else r.add_(nxt)
        ops.add_rowsum(nlayers, 0, gb)
    rows = ops.output_rows(inputs[-1])
    if energy_bar is not None:
        ops.add_weight_grad(nlayers, inputs[-1], energy_bar)
        ops.add_rowsum(nlayers, 1, energy_bar)
        y_bar = energy_bar * rows
    else:
        y_bar = rows.new_zeros(rows.shape)
    for k in range(nlayers - 1, -1, -1):
        n_in, skip, has_idt = layout[k]
        t_bar = y_bar * ops.idt(k) if has_idt else y_bar
        if has_idt:
            ops.add_rowsum(k, 2, y_bar * ts[k])
        extra = t_extra[k]
        if extra is not None:  # times −2: exact, so the same bits as adding −2·extra
            t_bar = torch.add(t_bar, extra, alpha=-2.0)
        a_bar = tanh_grad(t_bar, ts[k])
        onward = k > 0 or need_x
        y_bar = ops.layer_back(k, inputs[k], a_bar, fold(y_bar, skip, n_in), onward)
    return y_bar


class Gradients:
    """The parameters' gradients, each accumulated in place in the layout of its parameter."""

    def __init__(self, count: int) -> None:
        self.values: list[Tensor | None] = [None] * count

    def add(self, i: int, value: Tensor) -> None:
        current = self.values[i]
        self.values[i] = value if current is None else current.add_(value)

    def add_product(self, i: int, left: Tensor, right: Tensor) -> None:
        """``+= leftᵀ right`` (batched for three-dimensional operands)."""
        current = self.values[i]
        if current is None:
            self.values[i] = _mm(_tr(left), right)
        elif left.dim() == 2:
            current.addmm_(_tr(left), right)
        else:
            current.baddbmm_(_tr(left), right)


# One net, x (rows, n) with the parameters as the layers hold them, or K nets of one layout
# at once (a committee's members), x (K, rows, n) with the parameters stacked: W (K, n_in,
# n_out), b and idt (K, 1, n_out). These helpers take either form; on the first they are
# exactly the plain two-dimensional operations.


def _addmm(b: Tensor, x: Tensor, w: Tensor) -> Tensor:
    return torch.addmm(b, x, w) if x.dim() == 2 else torch.baddbmm(b, x, w)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    return torch.mm(a, b) if a.dim() == 2 else torch.bmm(a, b)


def _tr(a: Tensor) -> Tensor:
    return a.t() if a.dim() == 2 else a.transpose(1, 2)


def _rowsum(a: Tensor) -> Tensor:
    """The sum over rows, in the shape of a bias: (n,) or (K, 1, n)."""
    return a.sum(dim=0) if a.dim() == 2 else a.sum(dim=1, keepdim=True)


class DenseNets:
    """The products of one net, or of K stacked nets, on all rows at once."""

    def __init__(self, layout: Layout, params) -> None:
        self.layers = split(layout, params)
        self.offsets = offsets(layout)
        self.grads = Gradients(len(params))

    def idt(self, k: int) -> Tensor:
        return self.layers[k][2]

    def affine(self, k: int, x: Tensor) -> Tensor:
        w, b = self.layers[k][:2]
        return _addmm(b, x, w)

    def output_rows(self, x: Tensor) -> Tensor:
        """``wᵀ`` of the output layer on every row (a broadcast view)."""
        w_out = self.layers[-1][0]
        return _tr(w_out).expand(*x.shape[:-1], w_out.shape[-2])

    def times_wt(self, k: int, p: Tensor, fold: Tensor | None) -> Tensor:
        """``p Wᵀ (+ fold)``."""
        w = self.layers[k][0]
        return _mm(p, _tr(w)) if fold is None else _addmm(fold, p, _tr(w))

    def sweep_back(self, k: int, g: Tensor, p: Tensor) -> Tensor:
        """``g W``, and ``W̄ += gᵀ p``."""
        self.grads.add_product(self.offsets[k], g, p)
        return _mm(g, self.layers[k][0])

    def layer_back(
        self, k: int, x: Tensor, a_bar: Tensor, fold: Tensor | None, onward: bool
    ) -> Tensor | None:
        """``W̄ += xᵀ ā``, ``b̄ += Σ ā``, and (if ``onward``) ``ā Wᵀ (+ fold)``."""
        self.grads.add_product(self.offsets[k], x, a_bar)
        self.add_rowsum(k, 1, a_bar)
        return self.times_wt(k, a_bar, fold) if onward else None

    def add_weight_grad(self, k: int, left: Tensor, right: Tensor) -> None:
        self.grads.add_product(self.offsets[k], left, right)

    def add_rowsum(self, k: int, j: int, a: Tensor) -> None:
        """Parameter ``j`` of layer ``k`` gets the row sum of ``a``, in its own shape."""
        self.grads.add(self.offsets[k] + j, shaped(_rowsum(a), self.layers[k][j]))


def shaped(value: Tensor, like: Tensor) -> Tensor:
    """``value`` viewed in the shape of ``like`` (the output weight's gradient from a row sum)."""
    return value if value.shape == like.shape else value.view(like.shape)
