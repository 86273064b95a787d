"""Dense layers, layer stacks and layer normalisation with DeePMD-kit's semantics, and their
DeePMD-kit serialised form (``@class`` "Layer", "EmbeddingNetwork", "LayerNorm").

The type-embedding and attention descriptors need what `mdtrain.model.network` does not
have: layers without a bias (the type embedding), inputs of any width with the same residual
rules (``+x`` when out == in, ``+[x, x]`` when out == 2·in, only in residual stacks) and
DeePMD-kit's layer normalisation. Parameter names follow network.py: ``weight`` (in, out),
``bias``, ``idt``.
"""

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.network import activate, check_activation, child_seed

# DeePMD-kit spells the identity "Linear" or "none" (any case).
_IDENTITY = ("linear", "none")
DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32"}


def activation_name(name: str, where: str) -> str:
    """Our name of a DeePMD-kit activation (lower case; "Linear" is the identity)."""
    low = str(name).lower()
    if low in _IDENTITY:
        return "linear"
    return check_activation(low, where)


def _normal(shape, mean: float, std: float, gen, dtype) -> Tensor:
    return torch.normal(mean, std, size=shape, generator=gen, dtype=torch.float64).to(dtype)


class DenseLayer(nn.Module):
    """``y = act(x W + b)``, times ``idt`` if present, plus the residual when ``resnet``."""

    n_in: int
    n_out: int
    activation: str
    resnet: bool

    def __init__(
        self,
        n_in: int,
        n_out: int,
        activation: str = "linear",
        resnet: bool = False,
        bias: bool = True,
        use_timestep: bool = False,
        dtype: torch.dtype = torch.float64,
        seed: int | None = None,
        trainable: bool = True,
    ) -> None:
        super().__init__()
        self.n_in, self.n_out = int(n_in), int(n_out)
        self.activation = activation
        self.resnet = bool(resnet)
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        std = 1.0 / (n_in + n_out) ** 0.5
        self.weight = nn.Parameter(_normal((n_in, n_out), 0.0, std, gen, dtype), trainable)
        self.bias = (
            nn.Parameter(_normal((n_out,), 0.0, 1.0, gen, dtype), trainable) if bias else None
        )
        skip = n_out == n_in or n_out == 2 * n_in
        timestep = use_timestep and skip  # DeePMD-kit: a timestep only where a skip can be
        self.idt = (
            nn.Parameter(_normal((n_out,), 0.1, 0.001, gen, dtype), trainable) if timestep else None
        )

    def forward(self, x: Tensor) -> Tensor:
        y = torch.matmul(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        y = activate(y, self.activation)
        if self.idt is not None:
            y = y * self.idt
        if self.resnet and self.n_out == self.n_in:
            y = y + x
        elif self.resnet and self.n_out == 2 * self.n_in:  # + [x, x], without building it
            # (the leading sizes kept, not flattened to -1: torch.export cannot prove the
            # product of a free atom count back)
            y = (y.unflatten(-1, [2, self.n_in]) + x.unsqueeze(-2)).flatten(-2)
        return y

    def to_deepmd(self) -> dict:
        return {
            "@class": "Layer",
            "@version": 2,
            "bias": self.bias is not None,
            "use_timestep": self.idt is not None,
            "activation_function": "none" if self.activation == "linear" else self.activation,
            "resnet": self.resnet,
            "precision": DTYPE_NAMES[self.weight.dtype],
            "trainable": self.weight.requires_grad,
            "@variables": {
                "w": as_numpy(self.weight),
                "b": None if self.bias is None else as_numpy(self.bias),
                "idt": None if self.idt is None else as_numpy(self.idt),
            },
        }

    @classmethod
    def from_deepmd(cls, data: dict, dtype: torch.dtype, where: str) -> "DenseLayer":
        variables = data["@variables"]
        w = np.asarray(variables["w"])
        b, idt = variables.get("b"), variables.get("idt")
        layer = cls(
            w.shape[0],
            w.shape[1],
            activation_name(data.get("activation_function") or "none", where),
            bool(data.get("resnet", False)),
            bias=b is not None,
            use_timestep=idt is not None,
            dtype=dtype,
            trainable=bool(data.get("trainable", True)),
        )
        load(layer.weight, w, where)
        if b is not None:
            load(layer.bias, np.ravel(b), where)
        if idt is not None:
            if layer.idt is None:
                raise MDTrainError(f"{where}: a timestep on a layer without a skip connection")
            load(layer.idt, np.ravel(idt), where)
        return layer


class DenseNet(nn.Module):
    """DeePMD-kit's embedding network: residual layers ``n_in → neuron[0] → …``."""

    def __init__(
        self,
        n_in: int,
        neuron: list[int],
        activation: str,
        resnet_dt: bool = False,
        bias: bool = True,
        dtype: torch.dtype = torch.float64,
        seed: int | None = None,
        trainable: bool = True,
    ) -> None:
        super().__init__()
        dims = [int(n_in), *(int(n) for n in neuron)]
        self.n_in = dims[0]
        self.resnet_dt = bool(resnet_dt)
        self.layers = nn.ModuleList(
            DenseLayer(
                a, b, activation, True, bias, resnet_dt, dtype, child_seed(seed, k), trainable
            )
            for k, (a, b) in enumerate(zip(dims[:-1], dims[1:]))
        )

    @property
    def dim_out(self) -> int:
        return self.layers[-1].n_out if len(self.layers) else self.n_in

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def to_deepmd(self) -> dict:
        first = self.layers[0]
        return {
            "@class": "EmbeddingNetwork",
            "@version": 2,
            "in_dim": self.n_in,
            "neuron": [layer.n_out for layer in self.layers],
            "activation_function": first.to_deepmd()["activation_function"],
            "resnet_dt": self.resnet_dt,
            "bias": first.bias is not None,
            "precision": DTYPE_NAMES[first.weight.dtype],
            "layers": [layer.to_deepmd() for layer in self.layers],
        }

    @classmethod
    def from_deepmd(cls, data: dict, dtype: torch.dtype, where: str) -> "DenseNet":
        layers = data.get("layers") or []
        if not layers:
            raise MDTrainError(f"{where}: an embedding network without layers")
        net = cls(1, [], "linear", bool(data.get("resnet_dt", False)), dtype=dtype)
        net.layers = nn.ModuleList(
            DenseLayer.from_deepmd(layer, dtype, f"{where}.layers[{k}]")
            for k, layer in enumerate(layers)
        )
        net.n_in = net.layers[0].n_in
        return net


class LayerNorm(nn.Module):
    """``(x − mean)/sqrt(var + eps)·w + b`` over the last axis (population variance)."""

    eps: float

    def __init__(
        self, dim: int, eps: float = 1e-5, trainable: bool = True, dtype=torch.float64
    ) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), trainable)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), trainable)

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)

    def to_deepmd(self, precision: str | None = None) -> dict:
        """``precision``: the name to write (DeePMD-kit keeps the configured "default")."""
        return {
            "@class": "LayerNorm",
            "@version": 1,
            "eps": self.eps,
            "trainable": self.weight.requires_grad,
            "precision": precision or DTYPE_NAMES[self.weight.dtype],
            "@variables": {"w": as_numpy(self.weight), "b": as_numpy(self.bias)},
        }

    @classmethod
    def from_deepmd(cls, data: dict, dtype: torch.dtype, where: str) -> "LayerNorm":
        w = np.ravel(data["@variables"]["w"])
        norm = cls(
            w.shape[0], float(data.get("eps", 1e-5)), bool(data.get("trainable", True)), dtype
        )
        load(norm.weight, w, where)
        load(norm.bias, np.ravel(data["@variables"]["b"]), where)
        return norm


def as_numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().to("cpu").numpy().copy()


def load(target: Tensor, value: Any, where: str) -> None:
    """Copy a DeePMD-kit array into a parameter or buffer, checking its shape."""
    array = np.asarray(value)
    if tuple(array.shape) != tuple(target.shape):
        raise MDTrainError(
            f"{where}: array of shape {tuple(array.shape)} where {tuple(target.shape)} is expected"
        )
    with torch.no_grad():
        target.copy_(torch.as_tensor(array, dtype=target.dtype))
