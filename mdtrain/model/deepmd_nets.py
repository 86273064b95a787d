"""DeePMD-kit's serialised networks (layers, embedding and fitting nets, collections) both
ways, and the reader that checks a DeePMD dict while it is read: the pieces every part's
``.dp`` mapping (``deepmd_format.py``, each descriptor's ``to_deepmd``/``from_deepmd``)
shares."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mdtrain.config.mixed_types import shares_fitting_net
from mdtrain.errors import MDTrainError

PRECISION_NAMES = {torch.float64: "float64", torch.float32: "float32"}
# What a DeePMD file may name a precision; "default" is DeePMD-kit's global float64.
PRECISIONS = {"float64": "float64", "float32": "float32", "default": "float64"}
# DeePMD-kit's activation names that equal ours (its "gelu" is the tanh approximation).
ACTIVATIONS = ("tanh", "relu", "relu6", "softplus", "sigmoid", "silu", "gelu", "gelu_tf")


def to_numpy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    return tensor.detach().to("cpu", dtype or tensor.dtype).numpy().copy()


def activation_out(name: str, where: str) -> str:
    if name in ("linear", "none"):
        return "none"
    if name == "gelu_tf":  # the tanh form: DeePMD-kit's "gelu" everywhere (its TensorFlow
        return "gelu"  # "gelu_tf" is tf.nn.gelu, ~1e-9 away from it)
    if name not in ACTIVATIONS:
        raise MDTrainError(f"{where}: activation {name!r} has no DeePMD-kit equivalent")
    return name


def script_activations_out(script: dict) -> None:
    """The activation names of a ``model_def_script`` (descriptor, a hybrid's members, the
    fitting) in DeePMD-kit's spelling, in place."""
    desc = script["descriptor"]
    sections = [(s, f"model/descriptor/list[{k}]") for k, s in enumerate(desc.get("list", []))]
    sections += [(desc, "model/descriptor"), (script["fitting_net"], "model/fitting_net")]
    for section, where in sections:
        if "activation_function" in section:
            section["activation_function"] = activation_out(section["activation_function"], where)


def layer_dict(layer: torch.nn.Module, activation: str, resnet: bool, trainable: bool) -> dict:
    precision = PRECISION_NAMES[layer.weight.dtype]
    idt = layer.idt
    return {
        "@class": "Layer",
        "@version": 2,
        "bias": True,
        "use_timestep": idt is not None,
        "activation_function": activation,
        "resnet": resnet,
        "precision": precision,
        "trainable": trainable,
        "@variables": {
            "w": to_numpy(layer.weight),
            "b": to_numpy(layer.bias),
            "idt": None if idt is None else to_numpy(idt),
        },
    }


def embedding_net_dict(net: torch.nn.Module, neuron: list[int], cfg: dict, act: str) -> dict:
    trainable = bool(cfg["trainable"])
    return {
        "@class": "EmbeddingNetwork",
        "@version": 2,
        "in_dim": 1,
        "neuron": list(neuron),
        "activation_function": act,
        "resnet_dt": bool(cfg["resnet_dt"]),
        "bias": True,
        "precision": PRECISION_NAMES[net.layers[0].weight.dtype],
        "layers": [layer_dict(layer, act, True, trainable) for layer in net.layers],
    }


def fitting_net_dict(net: torch.nn.Module, dim_in: int, cfg: dict, act: str) -> dict:
    trainable = bool(cfg["trainable"])
    *hidden, out = net.layers
    return {
        "@class": "FittingNetwork",
        "@version": 1,
        "in_dim": dim_in,
        "out_dim": 1,
        "neuron": list(cfg["neuron"]),
        "activation_function": act,
        "resnet_dt": bool(cfg["resnet_dt"]),
        "precision": PRECISION_NAMES[out.weight.dtype],
        "bias_out": True,
        "layers": [layer_dict(layer, act, True, trainable) for layer in hidden]
        + [layer_dict(out, "none", False, trainable)],
    }


def collection_dict(networks: list[dict], ndim: int, ntypes: int, kind: str) -> dict:
    return {
        "@class": "NetworkCollection",
        "@version": 1,
        "ndim": ndim,
        "ntypes": ntypes,
        "network_type": kind,
        "networks": networks,
    }


# -- reading ---------------------------------------------------------------------------------


class Reader:
    """Checks a DeePMD dict while it is read; every refusal names the file and the key."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> MDTrainError:
        return MDTrainError(f"{self.source}: {where}: {what}")

    def get(self, d: Any, key: str, where: str) -> Any:
        if not isinstance(d, dict) or key not in d:
            raise self.fail(where, f"missing {key!r}")
        return d[key]

    def off(self, d: dict, key: str, where: str, what: str, allowed: tuple = (None,)) -> None:
        value = d.get(key)
        empty = isinstance(value, list | dict) and all(v is None for v in value)
        if value not in allowed and not empty:
            raise self.fail(f"{where}/{key}", f"{what} is not supported by mdtrain ({value!r})")

    def array(self, variables: dict, key: str, where: str) -> np.ndarray:
        value = self.get(variables, key, f"{where}/@variables")
        if value is None:
            raise self.fail(f"{where}/@variables/{key}", "missing array")
        return np.asarray(value)


def activation_in(r: Reader, name: Any, where: str) -> str:
    if not isinstance(name, str) or name.lower() not in (*ACTIVATIONS, "linear", "none"):
        raise r.fail(where, f"activation {name!r} is not supported by mdtrain")
    return name.lower()


def network_layers(r: Reader, net: dict, where: str, prefix: str, state: dict) -> list[dict]:
    layers = r.get(net, "layers", where)
    for i, layer in enumerate(layers):
        lw = f"{where}/layers/{i}"
        if layer.get("bias", True) is not True:
            raise r.fail(lw, "a layer without bias is not supported by mdtrain")
        variables = r.get(layer, "@variables", lw)
        w = r.array(variables, "w", lw)
        if w.ndim != 2:
            raise r.fail(f"{lw}/@variables/w", f"expected a matrix, got shape {w.shape}")
        state[f"{prefix}.layers.{i}.weight"] = torch.from_numpy(w.copy())
        state[f"{prefix}.layers.{i}.bias"] = torch.from_numpy(r.array(variables, "b", lw).ravel())
        if variables.get("idt") is not None:
            idt = np.asarray(variables["idt"]).ravel()
            state[f"{prefix}.layers.{i}.idt"] = torch.from_numpy(idt)
    return layers


def fitting_networks(r: Reader, f: dict, ntypes: int, where: str) -> list:
    """The serialised nets of fitting dict ``f``: one per type, or with ``mixed_types`` one
    for all (DeePMD-kit's ``NetworkCollection`` of ``ndim`` 0)."""
    mixed = f.get("mixed_types") or False
    if mixed not in (True, False):
        raise r.fail(f"{where}/mixed_types", f"{mixed!r} is not true or false")
    nets = r.get(r.get(f, "nets", where), "networks", f"{where}/nets")
    expected = 1 if mixed else ntypes
    if not isinstance(nets, list) or len(nets) != expected:
        count = len(nets) if isinstance(nets, list) else nets
        what = "one for all types" if mixed else f"one per type ({ntypes})"
        raise r.fail(f"{where}/nets", f"{count} networks, expected {what}")
    return nets


def check_fitting_follows(r: Reader, f: dict, descriptor: dict) -> None:
    """Refuse a fitting whose ``mixed_types`` is not its descriptor's: mdtrain builds the
    fitting as DeePMD-kit builds it from an input, one net for all types exactly when the
    descriptor is type-mixed (`mdtrain.config.shares_fitting_net`)."""
    mixed, shared = bool(f.get("mixed_types") or False), shares_fitting_net(descriptor)
    if mixed != shared:
        kind = descriptor.get("type")
        rule = "one net for all types" if shared else "one net per type"
        raise r.fail(
            "model/fitting/mixed_types",
            f"{mixed} with descriptor {kind}, whose fitting mdtrain (like DeePMD-kit) builds "
            f"with {rule}",
        )


def precision_in(r: Reader, value: Any, where: str) -> str:
    if value not in PRECISIONS:
        raise r.fail(f"{where}/precision", f"{value!r} is not supported by mdtrain")
    return PRECISIONS[value]


def param_stats_out(fit: torch.nn.Module) -> dict:
    """The fitting's fparam/aparam statistics as DeePMD-kit stores them (None when absent)."""
    out = {}
    for name in ("fparam_avg", "fparam_inv_std", "aparam_avg", "aparam_inv_std"):
        value = getattr(fit, name, None)
        out[name] = None if value is None else to_numpy(value, fit.dtype)
    return out


def param_stats_in(
    r: Reader, f: dict, counts: dict[str, int], state: dict, prefix: str = "fitting"
) -> None:
    """The fparam/aparam statistics of a DeePMD fitting dict into ``state`` (under
    ``<prefix>.``)."""
    variables = f.get("@variables") or {}
    for kind, count in counts.items():
        if count == 0:
            continue
        for stat, fill in (("avg", 0.0), ("inv_std", 1.0)):
            key = f"{kind}_{stat}"
            value = variables.get(key)
            value = np.full(count, fill) if value is None else np.asarray(value, np.float64)
            if value.size != count:
                raise r.fail(
                    f"model/fitting/@variables/{key}", f"{value.size} values, expected {count}"
                )
            state[f"{prefix}.{key}"] = torch.from_numpy(value.reshape(count).copy())
