"""Residual MLP layers shared by the embedding and fitting networks (DeePMD-compatible rules).

A layer computes ``y = act(x @ W + b)``, optionally scales it by a trainable timestep ``idt``,
then adds a skip connection: ``x`` when out == in, ``concat(x, x)`` when out == 2·in, nothing
otherwise. ``idt`` exists only when ``resnet_dt`` is on *and* the layer has a skip.
Initialisation: ``W ~ N(0, 1/sqrt(in+out))``, ``b ~ N(0, 1)``, ``idt ~ N(0.1, 0.001)``.
"""

import hashlib

import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model import fused_fitting

ACTIVATIONS = ("tanh", "relu", "relu6", "softplus", "sigmoid", "gelu", "gelu_tf", "linear", "none")
PRECISIONS = {"default": torch.float64, "float64": torch.float64, "float32": torch.float32}


def dtype_of(precision: str, where: str) -> torch.dtype:
    """Torch dtype of a ``precision`` setting ("default" means float64)."""
    if precision not in PRECISIONS:
        raise MDTrainError(f"{where}: precision {precision!r} is not one of {sorted(PRECISIONS)}")
    return PRECISIONS[precision]


def check_activation(name: str, where: str) -> str:
    if name not in ACTIVATIONS:
        raise MDTrainError(f"{where}: activation_function {name!r} is not one of {ACTIVATIONS}")
    return name


def activate(x: Tensor, name: str) -> Tensor:
    """Apply the named activation (a plain if-chain so that TorchScript can compile it)."""
    if name == "tanh":
        return torch.tanh(x)
    if name == "relu":
        return torch.relu(x)
    if name == "relu6":
        return torch.clamp(x, 0.0, 6.0)
    if name == "softplus":
        return torch.nn.functional.softplus(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "gelu":
        return torch.nn.functional.gelu(x)
    if name == "gelu_tf":
        return torch.nn.functional.gelu(x, approximate="tanh")
    return x


def tanh_grad(grad: Tensor, y: Tensor) -> Tensor:
    """``grad · (1 − y²)``, the chain rule through ``y = tanh(x)``: one fused pass, and itself
    differentiable (so explicit derivatives built from it train with a first-order backward)."""
    return torch.ops.aten.tanh_backward(grad, y)


def child_seed(seed: int | None, *path: int) -> int | None:
    """A reproducible 63-bit seed for one layer of one network, derived from the user seed.

    ``None`` stays ``None`` (the global torch RNG is then used), so runs without a seed behave
    like any other torch module.
    """
    if seed is None:
        return None
    text = ",".join(str(int(v)) for v in (seed, *path))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _normal(shape: tuple[int, ...], mean: float, std: float, gen: torch.Generator | None) -> Tensor:
    return torch.normal(mean, std, size=shape, generator=gen, dtype=torch.float64)


class ResidualLayer(nn.Module):
    """One dense layer with DeePMD's residual rules; the input must be 2-D (rows, n_in)."""

    n_in: int
    n_out: int
    skip: int  # 0: none, 1: + x, 2: + concat(x, x)
    activation: str

    def __init__(
        self,
        n_in: int,
        n_out: int,
        activation: str,
        resnet: bool,
        resnet_dt: bool,
        dtype: torch.dtype,
        seed: int | None,
    ) -> None:
        super().__init__()
        self.n_in = n_in
        self.n_out = n_out
        self.activation = activation
        skip = 0
        if resnet and n_out == n_in:
            skip = 1
        elif resnet and n_out == 2 * n_in:
            skip = 2
        self.skip = skip
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        std = 1.0 / (n_in + n_out) ** 0.5
        self.weight = nn.Parameter(_normal((n_in, n_out), 0.0, std, gen).to(dtype))
        self.bias = nn.Parameter(_normal((n_out,), 0.0, 1.0, gen).to(dtype))
        if resnet_dt and skip != 0:
            self.idt = nn.Parameter(_normal((n_out,), 0.1, 0.001, gen).to(dtype))
        else:
            self.register_parameter("idt", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.n_in == 1:
            y = torch.addcmul(self.bias, x, self.weight)  # outer product, one fused pass
        else:
            # back to x's dtype at once: bf16 under autocast (mdtrain.train.precision)
            y = torch.addmm(self.bias, x, self.weight).to(x.dtype)
        y = activate(y, self.activation)
        idt = self.idt
        if idt is not None:
            y = y * idt
        if self.skip == 1:
            y = y + x
        elif self.skip == 2:
            y = (y.view(-1, 2, self.n_in) + x.unsqueeze(1)).view(-1, self.n_out)
        return y


def _hidden_layers(
    n_in: int,
    neuron: list[int],
    activation: str,
    resnet_dt: bool,
    dtype: torch.dtype,
    seed: int | None,
) -> list[ResidualLayer]:
    layers = []
    for i, n_out in enumerate(neuron):
        layers.append(
            ResidualLayer(n_in, n_out, activation, True, resnet_dt, dtype, child_seed(seed, i))
        )
        n_in = n_out
    return layers


class EmbeddingNet(nn.Module):
    """Maps the normalised radial column s (rows, 1) to G (rows, neuron[-1])."""

    has_tangent: bool
    fused_backward: bool

    def __init__(
        self,
        neuron: list[int],
        activation: str,
        resnet_dt: bool,
        dtype: torch.dtype,
        seed: int | None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_hidden_layers(1, neuron, activation, resnet_dt, dtype, seed))
        self.has_tangent = activation == "tanh"
        self.fused_backward = True

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def value_and_derivative(self, s: Tensor) -> tuple[Tensor, Tensor]:
        """G(s) and dG/ds (rows, M) in one forward pass (forward-mode along the scalar input).

        With dG/ds as an explicit tensor, forces need no backward pass through the net, and
        the force loss needs only a first-order backward through it instead of a double
        backward: the main saving of the training step. tanh only (``has_tangent``).
        Outside TorchScript this runs as one autograd node with a hand-written backward
        (``_ValueAndSlope``: fewer passes over the (rows, M) tensors than the generic one);
        ``value_and_derivative_ops`` is the same function in plain differentiable operations.
        """
        if torch.jit.is_scripting() or not self.fused_backward:
            return self.value_and_derivative_ops(s)
        return self._value_and_slope(s)

    @torch.jit.unused
    def _layout_and_params(self) -> tuple[tuple, list[Tensor]]:
        layout = tuple((ly.n_in, ly.skip, ly.idt is not None) for ly in self.layers)
        params = []
        for ly in self.layers:
            params += [ly.weight, ly.bias] + ([ly.idt] if ly.idt is not None else [])
        return layout, params

    @torch.jit.unused
    def _value_and_slope(self, s: Tensor) -> tuple[Tensor, Tensor]:
        layout, params = self._layout_and_params()
        return _ValueAndSlope.apply(s, layout, *params)

    @torch.jit.unused
    def embed_contract(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(Σ_j R̃_jᵀ G(s_j), G, dG/ds)`` for rows (B, 4, n), ``s = rows[:, 0]``, as one
        autograd node (eager only; see ``_EmbedContract``)."""
        layout, params = self._layout_and_params()
        return _EmbedContract.apply(rows, layout, *params)

    def value_and_derivative_ops(self, s: Tensor) -> tuple[Tensor, Tensor]:
        """``value_and_derivative`` as plain operations (differentiable any number of times)."""
        x, dx = s, torch.ones_like(s)
        for layer in self.layers:
            if layer.n_in == 1:
                pre = torch.addcmul(layer.bias, x, layer.weight)
                dpre = dx * layer.weight
            else:  # matmul outputs back to x's dtype at once (bf16 under autocast)
                pre = torch.addmm(layer.bias, x, layer.weight).to(x.dtype)
                dpre = torch.mm(dx, layer.weight).to(x.dtype)
            y = torch.tanh(pre)
            dy = tanh_grad(dpre, y)
            idt = layer.idt
            if idt is not None:
                y = y * idt
                dy = dy * idt
            if layer.skip == 1:
                y = y + x
                dy = dy + dx
            elif layer.skip == 2:
                y = (y.view(-1, 2, layer.n_in) + x.unsqueeze(1)).view(-1, layer.n_out)
                dy = (dy.view(-1, 2, layer.n_in) + dx.unsqueeze(1)).view(-1, layer.n_out)
            x, dx = y, dy
        return x, dx


def row_grad_fused(tbar: Tensor, value: Tensor, slope: Tensor, rows: Tensor) -> Tensor:
    """dE/dR̃ (B, n, 4) = ``G T̄ᵀ + [R̃·(G' T̄ᵀ), 0, 0, 0]`` for rows (B, 4, n): the
    ``_RowGrad`` node (eager only), whose backward hands its gradient to the
    ``_EmbedContract`` node that made G and G' in factored form."""
    return _RowGrad.apply(tbar, value, slope, rows)


def _add_cross_product(total: Tensor, left: Tensor, right: Tensor) -> None:
    """``total += leftᵀ right`` over many rows. Split into two halves of rows, the two
    products run as one batched product, one per thread, and are then added: 10–20 % faster
    for these narrow shapes than one product split by the BLAS library."""
    rows = left.shape[0]
    if rows % 2 or rows < 512 or left.shape[1] == 1:
        total.addmm_(left.t(), right)
        return
    halves = torch.bmm(left.view(2, rows // 2, -1).transpose(1, 2), right.view(2, rows // 2, -1))
    total += halves[0]
    total += halves[1]


def _fold(grad: Tensor, skip: int, n_in: int) -> Tensor | None:
    """Gradient reaching a layer's input through its skip connection."""
    if skip == 1:
        return grad
    if skip == 2:
        return torch.add(grad[:, :n_in], grad[:, n_in:])  # faster than a 2-wide reduction
    return None


class _Tape:
    """Buffers of one fused evaluation of a tanh embedding net on ``rows`` inputs ``s``.

    Per layer ``a = xW + b, t = tanh(a), y = t·idt + skip(x)`` and the tangent ``da = dx W,
    dt = da(1 − t²), dy = dt·idt + skip(dx)`` (dx = 1 at the input). The backward takes
    ``(ȳ, dȳ)`` to ``dā = dȳ·idt(1 − t²)``, ``ā = (ȳ·idt − 2t·da·dȳ·idt)(1 − t²)``,
    ``W̄ = xᵀā + dxᵀdā``, ``b̄ = Σā``, ``x̄ = āWᵀ + fold(ȳ)``, ``dx̄ = dāWᵀ + fold(dȳ)``.
    Both directions run over blocks of rows through all layers (``forward_rows``,
    ``backward_rows``), so that a block's intermediate tensors stay in cache between the
    operations on them (the step is memory-bound); only what the backward needs (t, da and
    the layer outputs) is kept for all rows.
    """

    block_bytes = 1 << 21  # one (rows, widest layer) block: about a core's L2
    min_block_rows = 256

    def __init__(self, s: Tensor, layout: tuple, params: tuple, saved: tuple = ()) -> None:
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
            self.outs.append(t if plain else torch.empty(rows, n_out, **opts))
            self.douts.append(torch.empty(rows, n_out, **opts))
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
            _add_cross_product(grads[k], x, abar)
            if dx is None:
                grads[k] += dabar.sum(dim=0, keepdim=True)
            else:
                _add_cross_product(grads[k], dx, dabar)
            grads[k + 1] += abar.sum(dim=0)
            wt = w.t()
            fold = _fold(gy, skip, n_in)
            gx = torch.mm(abar, wt) if fold is None else torch.addmm(fold, abar, wt)
            if layer > 0:
                dfold = _fold(gdy, skip, n_in)
                gdy = torch.mm(dabar, wt) if dfold is None else torch.addmm(dfold, dabar, wt)
            gy = gx
        return gy


class _ValueAndSlope(torch.autograd.Function):
    """(G, dG/ds) of a tanh embedding net as one autograd node (see ``_Tape``). First-order
    only: it is never differentiated again (forces do not backpropagate through it)."""

    @staticmethod
    def forward(ctx, s: Tensor, layout: tuple, *params: Tensor) -> tuple[Tensor, Tensor]:
        tape = _Tape(s, layout, params)
        for lo in range(0, s.shape[0], tape.block):
            tape.forward_rows(lo, min(lo + tape.block, s.shape[0]))
        ctx.layout = layout
        ctx.save_for_backward(s, *params, *tape.saved_tensors())
        return tape.value, tape.slope

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy: Tensor, gdy: Tensor):
        s, *rest = ctx.saved_tensors
        nparams = sum(3 if has_idt else 2 for _, _, has_idt in ctx.layout)
        tape = _Tape(s, ctx.layout, tuple(rest[:nparams]), tuple(rest[nparams:]))
        grads = tape.new_grads()
        s_grad = torch.empty_like(s) if ctx.needs_input_grad[0] else None
        rows = s.shape[0]
        for lo in range(0, rows, tape.block):
            hi = min(lo + tape.block, rows)
            g = tape.backward_rows(lo, hi, gy[lo:hi], gdy[lo:hi], grads)
            if s_grad is not None:
                s_grad[lo:hi] = g
        return (s_grad, None, *grads)


class _EmbedContract(torch.autograd.Function):
    """``T = Σ_j R̃_jᵀ G(s_j)`` (B, 4, M) for rows ``R̃`` (B, 4, n) with ``s = R̃[:, 0]``; also
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
        tape = _Tape(s, layout, params)
        m = tape.value.shape[1]
        tmat = rows.new_empty(nc, 4, m)
        per = max(1, tape.block // n)
        for c0 in range(0, nc, per):
            c1 = min(c0 + per, nc)
            tape.forward_rows(c0 * n, c1 * n)
            g = tape.value[c0 * n : c1 * n].view(c1 - c0, n, m)
            torch.bmm(rows[c0:c1], g, out=tmat[c0:c1])
        ctx.layout, ctx.centres = layout, per
        ctx.row_grad = None
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(rows, s, *params, *tape.saved_tensors())
        value = tape.value.view(nc, n, m)
        slope = tape.slope.view(nc, n, m)
        return tmat, value, slope

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, tbar_t: Tensor | None, gv: Tensor | None, gs: Tensor | None):
        rows, s, *rest = ctx.saved_tensors
        nparams = sum(3 if has_idt else 2 for _, _, has_idt in ctx.layout)
        tape = _Tape(s, ctx.layout, tuple(rest[:nparams]), tuple(rest[nparams:]))
        grads = tape.new_grads()
        nc, n = rows.shape[0], rows.shape[2]
        m = tape.value.shape[1]
        rows_t = rows.transpose(1, 2)  # (B, n, 4)
        row_grad, ctx.row_grad = ctx.row_grad, None
        per = ctx.centres
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
    """dE/dR̃ (B, n, 4) of one block of slot columns from T̄ = dE/dT (B, 4, M):
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
        zr = rows.transpose(1, 2) * z[:, :, :1]  # (B, n, 4)
        tbar_grad = torch.bmm(z.transpose(1, 2), value).baddbmm_(zr.transpose(1, 2), slope)
        producer = ctx.producer
        if producer is not None and isinstance(producer, _EmbedContract._backward_cls):
            producer.row_grad = (z, zr, tbar)
            return tbar_grad, None, None, None
        gv = torch.bmm(z, tbar)
        gs = torch.bmm(zr, tbar)
        return tbar_grad, gv, gs, None


def output_layer(weight: Tensor, bias: Tensor, x: Tensor) -> Tensor:
    """A fitting net's one-output linear layer as a multiply and a row sum, which autocast
    leaves in the working precision: under bf16 autocast a product would round the atomic
    energy itself to bfloat16's 8 significant bits."""
    return (x * weight.view(1, -1)).sum(dim=1, keepdim=True) + bias


class FittingNet(nn.Module):
    """Residual hidden layers then a linear output layer (rows, n_in) -> (rows, 1)."""

    has_tangent: bool
    fused_backward: bool

    def __init__(
        self,
        n_in: int,
        neuron: list[int],
        activation: str,
        resnet_dt: bool,
        dtype: torch.dtype,
        seed: int | None,
    ) -> None:
        super().__init__()
        hidden = _hidden_layers(n_in, neuron, activation, resnet_dt, dtype, seed)
        last = neuron[-1] if neuron else n_in
        out = ResidualLayer(last, 1, "linear", False, False, dtype, child_seed(seed, len(neuron)))
        self.layers = nn.ModuleList([*hidden, out])
        self.has_tangent = activation == "tanh"
        self.fused_backward = True

    def forward(self, x: Tensor) -> Tensor:
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x) if i < n - 1 else output_layer(layer.weight, layer.bias, x)
        return x

    def value_and_input_grad(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The output (rows, 1) and its gradient w.r.t. the input (rows, n_in), written as
        explicit tensor operations (tanh only, ``has_tangent``).

        Unlike ``autograd.grad(..., create_graph=True)``, the gradient is then an ordinary
        function of the parameters, so a loss on it trains with a first-order backward.
        Outside TorchScript this is one autograd node with a written-out backward
        (``mdtrain.model.fused_fitting``); ``value_and_input_grad_ops`` is the same function in
        plain operations.
        """
        if torch.jit.is_scripting() or not self.fused_backward:
            return self.value_and_input_grad_ops(x)
        return self._value_and_input_grad_fused(x)

    @torch.jit.unused
    def _value_and_input_grad_fused(self, x: Tensor) -> tuple[Tensor, Tensor]:
        hidden = self.layers[:-1]
        layout = tuple((ly.n_in, ly.skip, ly.idt is not None) for ly in hidden)
        params = []
        for ly in self.layers:
            params += [ly.weight, ly.bias] + ([ly.idt] if ly.idt is not None else [])
        return fused_fitting.value_and_input_grad(x, layout, params)

    def value_and_input_grad_ops(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``value_and_input_grad`` as plain differentiable operations."""
        weights: list[Tensor] = []
        scales: list[Tensor] = []  # idt, or an empty tensor when the layer has none
        outputs: list[Tensor] = []  # tanh outputs of the hidden layers
        skips: list[int] = []
        for layer in self.layers:
            weights.append(layer.weight)
            skips.append(layer.skip)
            if layer.activation == "linear":  # the output layer
                x = output_layer(layer.weight, layer.bias, x)
                outputs.append(x)
                scales.append(x.new_empty(0))
            else:
                pre = torch.addmm(layer.bias, x, layer.weight).to(x.dtype)  # from bf16 autocast
                t = torch.tanh(pre)
                outputs.append(t)
                y = t
                idt = layer.idt
                if idt is not None:
                    y = y * idt
                    scales.append(idt)
                else:
                    scales.append(t.new_empty(0))
                if layer.skip == 1:
                    y = y + x
                elif layer.skip == 2:
                    y = (y.view(-1, 2, layer.n_in) + x.unsqueeze(1)).view(-1, layer.n_out)
                x = y
        # backward sweep: the last layer is linear with one output
        grad = weights[-1].t().expand(x.shape[0], weights[-1].shape[0])
        for k in range(len(weights) - 2, -1, -1):
            w, idt, skip = weights[k], scales[k], skips[k]
            g = grad * idt if idt.numel() > 0 else grad
            pre_grad = tanh_grad(g, outputs[k])
            below = torch.mm(pre_grad, w.t()).to(pre_grad.dtype)
            if skip == 1:
                below = below + grad
            elif skip == 2:
                below = below + grad.view(-1, 2, w.shape[0]).sum(dim=1)
            grad = below
        return x, grad
