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
from mdtrain.model import fused_embedding, fused_fitting
from mdtrain.model.fused_embedding import tanh_grad

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


def fused_layout(layers) -> tuple[tuple[int, int, bool], ...]:
    """What the fused nodes need to know of each layer: (n_in, skip kind, has idt)."""
    return tuple((ly.n_in, ly.skip, ly.idt is not None) for ly in layers)


def fused_params(layers) -> list[Tensor]:
    """The layers' parameters in the order the fused nodes read them: W, b[, idt] each."""
    params: list[Tensor] = []
    for ly in layers:
        params += [ly.weight, ly.bias] + ([ly.idt] if ly.idt is not None else [])
    return params


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
        (``mdtrain.model.fused_embedding``: fewer passes over the (rows, M) tensors than the
        generic one);
        ``value_and_derivative_ops`` is the same function in plain differentiable operations.
        """
        if torch.jit.is_scripting() or not self.fused_backward:
            return self.value_and_derivative_ops(s)
        return self._value_and_slope(s)

    @torch.jit.unused
    def _value_and_slope(self, s: Tensor) -> tuple[Tensor, Tensor]:
        layout, params = fused_layout(self.layers), fused_params(self.layers)
        return fused_embedding.value_and_slope(s, layout, params)

    @torch.jit.unused
    def embed_contract(
        self, rows: Tensor, used: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """``(Σ_j R̃_jᵀ G(s_j), G, dG/ds, plan)`` for rows (B, 4, n), ``s = rows[:, 0]``, as one
        autograd node (eager only; see ``mdtrain.model.fused_embedding.embed_contract``, also
        for ``used`` and the plan)."""
        layout, params = fused_layout(self.layers), fused_params(self.layers)
        return fused_embedding.embed_contract(rows, layout, params, used)

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
        layout = fused_layout(self.layers[:-1])  # the hidden layers; the output layer is fixed
        return fused_fitting.value_and_input_grad(x, layout, fused_params(self.layers))

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
