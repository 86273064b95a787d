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
            y = torch.addmm(self.bias, x, self.weight)
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
    def _value_and_slope(self, s: Tensor) -> tuple[Tensor, Tensor]:
        layout = tuple((ly.n_in, ly.skip, ly.idt is not None) for ly in self.layers)
        params = []
        for ly in self.layers:
            params += [ly.weight, ly.bias] + ([ly.idt] if ly.idt is not None else [])
        return _ValueAndSlope.apply(s, layout, *params)

    def value_and_derivative_ops(self, s: Tensor) -> tuple[Tensor, Tensor]:
        """``value_and_derivative`` as plain operations (differentiable any number of times)."""
        x, dx = s, torch.ones_like(s)
        for layer in self.layers:
            if layer.n_in == 1:
                pre = torch.addcmul(layer.bias, x, layer.weight)
                dpre = dx * layer.weight
            else:
                pre = torch.addmm(layer.bias, x, layer.weight)
                dpre = torch.mm(dx, layer.weight)
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


def _fold(grad: Tensor, skip: int, n_in: int) -> Tensor | None:
    """Gradient reaching a layer's input through its skip connection."""
    if skip == 1:
        return grad
    if skip == 2:
        return grad.view(-1, 2, n_in).sum(dim=1)
    return None


class _ValueAndSlope(torch.autograd.Function):
    """(G, dG/ds) of a tanh embedding net as one autograd node.

    Per layer ``a = xW + b, t = tanh(a), y = t·idt + skip(x)`` and the tangent ``da = dx W,
    dt = da(1 − t²), dy = dt·idt + skip(dx)`` (dx = 1 at the input). The backward takes
    ``(ȳ, dȳ)`` to ``dā = dȳ·idt(1 − t²)``, ``ā = (ȳ·idt − 2t·da·dȳ·idt)(1 − t²)``,
    ``W̄ = xᵀā + dxᵀdā``, ``b̄ = Σā``, ``x̄ = āWᵀ + fold(ȳ)``, ``dx̄ = dāWᵀ + fold(dȳ)``.
    Both directions run over blocks of rows through all layers, so that a block's
    intermediate tensors stay in cache between the operations on them (the step is
    memory-bound); only what the backward needs (t, da and the layer outputs) is kept for all
    rows. First-order only: it is never differentiated again (forces do not backpropagate
    through it).
    """

    block_bytes = 1 << 21  # one (rows, widest layer) block: about a core's L2
    min_block_rows = 256

    @staticmethod
    def block_rows(layout: tuple, params: tuple, itemsize: int) -> int:
        width = max(int(p.shape[-1]) for p in params)
        rows = _ValueAndSlope.block_bytes // (width * itemsize)
        return max(_ValueAndSlope.min_block_rows, rows)

    @staticmethod
    def specs(layout: tuple) -> list[tuple[int, int, int, bool]]:
        """Per layer: index of its weight in ``params``, n_in, skip kind, whether it has idt."""
        out, k = [], 0
        for n_in, skip, has_idt in layout:
            out.append((k, n_in, skip, has_idt))
            k += 3 if has_idt else 2
        return out

    @staticmethod
    def forward(ctx, s: Tensor, layout: tuple, *params: Tensor) -> tuple[Tensor, Tensor]:
        rows = s.shape[0]
        block = _ValueAndSlope.block_rows(layout, params, s.element_size())
        specs = _ValueAndSlope.specs(layout)
        opts = {"dtype": s.dtype, "device": s.device}
        outs, douts, ts, das = [], [], [], []
        for layer, (k, _, skip, has_idt) in enumerate(specs):
            n_out = params[k].shape[1]
            t = torch.empty(rows, n_out, **opts)
            ts.append(t)
            # y = t needs no copy; the first layer's da is W itself (dx = 1)
            outs.append(t if skip == 0 and not has_idt else torch.empty(rows, n_out, **opts))
            douts.append(torch.empty(rows, n_out, **opts))
            das.append(None if layer == 0 else torch.empty(rows, n_out, **opts))
        for lo in range(0, rows, block):
            hi = min(lo + block, rows)
            x, dx = s[lo:hi], None
            for layer, (k, n_in, skip, has_idt) in enumerate(specs):
                w, b = params[k], params[k + 1]
                t, y, dy = ts[layer][lo:hi], outs[layer][lo:hi], douts[layer][lo:hi]
                if dx is None:
                    torch.addcmul(b, x, w, out=t) if n_in == 1 else torch.addmm(b, x, w, out=t)
                    da = w.expand(hi - lo, w.shape[1])
                else:
                    da = das[layer][lo:hi]
                    if n_in == 1:
                        torch.addcmul(b, x, w, out=t)
                        torch.mul(dx, w, out=da)
                    else:
                        torch.addmm(b, x, w, out=t)
                        torch.mm(dx, w, out=da)
                t.tanh_()
                torch.ops.aten.tanh_backward.grad_input(da, t, grad_input=dy)
                if has_idt:
                    idt = params[k + 2]
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
        ctx.layout = layout
        ctx.save_for_backward(s, *outs[:-1], *douts[:-1], *ts, *das[1:], *params)
        return outs[-1], douts[-1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy_all: Tensor, gdy_all: Tensor):
        layout = ctx.layout
        n = len(layout)
        saved = ctx.saved_tensors
        s, outs, douts = saved[0], saved[1:n], saved[n : 2 * n - 1]
        ts, das = saved[2 * n - 1 : 3 * n - 1], (None, *saved[3 * n - 1 : 4 * n - 2])
        params = saved[4 * n - 2 :]
        specs = _ValueAndSlope.specs(layout)
        grads: list[Tensor | None] = [None] * len(params)
        for k, _, _, has_idt in specs:
            for j in range(3 if has_idt else 2):
                grads[k + j] = torch.zeros_like(params[k + j])
        rows = s.shape[0]
        block = _ValueAndSlope.block_rows(layout, params, s.element_size())
        need_s = ctx.needs_input_grad[0]
        s_grad = torch.empty_like(s) if need_s else None
        for lo in range(0, rows, block):
            hi = min(lo + block, rows)
            gy, gdy = gy_all[lo:hi], gdy_all[lo:hi]
            for layer in range(n - 1, -1, -1):
                k, n_in, skip, has_idt = specs[layer]
                w, t = params[k], ts[layer][lo:hi]
                x = s[lo:hi] if layer == 0 else outs[layer - 1][lo:hi]
                dx = None if layer == 0 else douts[layer - 1][lo:hi]
                da = w.expand(hi - lo, w.shape[1]) if layer == 0 else das[layer][lo:hi]
                q, dq = gy, gdy
                if has_idt:
                    idt = params[k + 2]
                    grads[k + 2] += (gy * t).sum(dim=0) + (gdy * tanh_grad(da, t)).sum(dim=0)
                    q, dq = gy * idt, gdy * idt
                dabar = tanh_grad(dq, t)
                abar = torch.addcmul(q, t, da * dq, value=-2.0)
                torch.ops.aten.tanh_backward.grad_input(abar, t, grad_input=abar)
                grads[k].addmm_(x.t(), abar)
                if dx is None:
                    grads[k] += dabar.sum(dim=0, keepdim=True)
                else:
                    grads[k].addmm_(dx.t(), dabar)
                grads[k + 1] += abar.sum(dim=0)
                wt = w.t()
                fold = _fold(gy, skip, n_in)
                if layer == 0:
                    if need_s:
                        s_grad[lo:hi] = torch.mm(abar, wt) if fold is None else fold.addmm(abar, wt)
                    break
                gx = torch.mm(abar, wt) if fold is None else torch.addmm(fold, abar, wt)
                dfold = _fold(gdy, skip, n_in)
                gdy = torch.mm(dabar, wt) if dfold is None else torch.addmm(dfold, dabar, wt)
                gy = gx
        return (s_grad, None, *grads)


class FittingNet(nn.Module):
    """Residual hidden layers then a linear output layer (rows, n_in) -> (rows, 1)."""

    has_tangent: bool

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

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def value_and_input_grad(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The output (rows, 1) and its gradient w.r.t. the input (rows, n_in), written as
        explicit tensor operations (tanh only, ``has_tangent``).

        Unlike ``autograd.grad(..., create_graph=True)``, the gradient is then an ordinary
        function of the parameters, so a loss on it trains with a first-order backward.
        """
        weights: list[Tensor] = []
        scales: list[Tensor] = []  # idt, or an empty tensor when the layer has none
        outputs: list[Tensor] = []  # tanh outputs of the hidden layers
        skips: list[int] = []
        for layer in self.layers:
            weights.append(layer.weight)
            skips.append(layer.skip)
            pre = torch.addmm(layer.bias, x, layer.weight)
            if layer.activation == "linear":
                outputs.append(pre)
                scales.append(pre.new_empty(0))
                x = pre
            else:
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
            below = torch.mm(pre_grad, w.t())
            if skip == 1:
                below = below + grad
            elif skip == 2:
                below = below + grad.view(-1, 2, w.shape[0]).sum(dim=1)
            grad = below
        return x, grad
