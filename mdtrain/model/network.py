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

# DeePMD-kit's names (its PyTorch backend), plus ``gelu_erf``: the exact GELU that mdtrain's
# "gelu" meant before it followed DeePMD-kit (old checkpoints keep it; see model/config.py).
ACTIVATIONS = (
    "tanh",
    "relu",
    "relu6",
    "softplus",
    "sigmoid",
    "silu",
    "gelu",
    "gelu_tf",
    "gelu_erf",
    "linear",
    "none",
)
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
    """Apply the named activation (a plain if-chain so that TorchScript can compile it).

    As in DeePMD-kit's PyTorch backend, "gelu" and "gelu_tf" are both the tanh approximation
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``; "gelu_erf" is the exact
    ``0.5 x (1 + erf(x / sqrt(2)))``; "relu6" is ``min(max(x, 0), 6)``; "linear" and "none"
    are the identity.
    """
    if name == "tanh":
        return torch.tanh(x)
    if name == "relu":
        return torch.relu(x)
    if name == "relu6":
        return torch.nn.functional.relu6(x)
    if name == "softplus":
        return torch.nn.functional.softplus(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "silu":
        return torch.nn.functional.silu(x)
    if name == "gelu" or name == "gelu_tf":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if name == "gelu_erf":
        return torch.nn.functional.gelu(x)
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

    def product(self, x: Tensor) -> Tensor:
        """``x @ weight + bias`` in x's dtype (`mdtrain.model.autocast` computes it in a lower
        precision)."""
        if self.n_in == 1:
            return torch.addcmul(self.bias, x, self.weight)  # outer product, one fused pass
        return torch.addmm(self.bias, x, self.weight)

    def forward(self, x: Tensor) -> Tensor:
        y = activate(self.product(x), self.activation)
        idt = self.idt
        if idt is not None:
            y = y * idt
        if self.skip == 1:
            y = y + x
        elif self.skip == 2:
            y = (y.view(-1, 2, self.n_in) + x.unsqueeze(1)).view(-1, self.n_out)
        return y


def residual_by_cat(z: Tensor, x: Tensor, activation: str, idt: Tensor | None, skip: int) -> Tensor:
    """``ResidualLayer.forward`` from its product ``z``, the doubled skip ``concat(x, x)``
    built by a cat: its gradient is two slices added, not a sum over a middle axis of 2,
    which costs more than the whole layer on the millions of rows of se_e3's pair nets. The
    same values; the gradients to rounding (they accumulate in another order)."""
    y = activate(z, activation)
    if idt is not None:
        y = y * idt
    if skip == 1:
        y = y + x
    elif skip == 2:
        y = y + torch.cat([x, x], dim=1)
    return y


def hidden_layers(
    n_in: int,
    neuron: list[int],
    activation: str,
    resnet_dt: bool,
    dtype: torch.dtype,
    seed: int | None,
) -> list[ResidualLayer]:
    """The residual hidden layers of an embedding or fitting net, layer i seeded
    ``child_seed(seed, i)``."""
    layers = []
    for i, n_out in enumerate(neuron):
        layers.append(
            ResidualLayer(n_in, n_out, activation, True, resnet_dt, dtype, child_seed(seed, i))
        )
        n_in = n_out
    return layers


class EmbeddingNet(nn.Module):
    """Maps the normalised radial column s (rows, 1) to G (rows, neuron[-1])."""

    def __init__(
        self,
        neuron: list[int],
        activation: str,
        resnet_dt: bool,
        dtype: torch.dtype,
        seed: int | None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(hidden_layers(1, neuron, activation, resnet_dt, dtype, seed))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def output_layer(weight: Tensor, bias: Tensor, x: Tensor) -> Tensor:
    """A fitting net's one-output linear layer as a multiply and a row sum, which autocast
    leaves in the working precision: under bf16 autocast a product would round the atomic
    energy itself to bfloat16's 8 significant bits."""
    return (x * weight.view(1, -1)).sum(dim=1, keepdim=True) + bias


class FittingNet(nn.Module):
    """Residual hidden layers then a linear output layer (rows, n_in) -> (rows, 1)."""

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
        hidden = hidden_layers(n_in, neuron, activation, resnet_dt, dtype, seed)
        last = neuron[-1] if neuron else n_in
        out = ResidualLayer(last, 1, "linear", False, False, dtype, child_seed(seed, len(neuron)))
        self.layers = nn.ModuleList([*hidden, out])

    def forward(self, x: Tensor) -> Tensor:
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x) if i < n - 1 else output_layer(layer.weight, layer.bias, x)
        return x
