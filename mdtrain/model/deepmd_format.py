"""An mdtrain energy model as DeePMD-kit's serialised model dict, and back.

DeePMD-kit 3.x describes a model backend-independently as nested dicts (``@class``,
``@version``, settings) whose arrays sit under ``@variables`` keys; ``.dp`` files store that
dict (``mdtrain.model.deepmd_file``). Our se_e2_a model has DeePMD-kit's semantics, so the
mapping is one to one: layer ``w``/``b``/``idt`` are our ``weight``/``bias``/``idt``, the
embedding nets are indexed ``centre + neighbour·ntypes`` (or by neighbour with
``type_one_side``) in both, davg/dstd have the same shape, and the energy bias is the atomic
model's ``out_bias`` plus the fitting's ``bias_atom_e`` (we write it as ``bias_atom_e``).
Anything a DeePMD file may hold that this model cannot run is refused by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.config import normalize_model_config

_PRECISION_NAMES = {torch.float64: "float64", torch.float32: "float32"}
# What a DeePMD file may name a precision; "default" is DeePMD-kit's global float64.
_PRECISIONS = {"float64": "float64", "float32": "float32", "default": "float64"}
# DeePMD-kit's activation names that equal ours (its "gelu" is the tanh approximation).
_ACTIVATIONS = ("tanh", "relu", "relu6", "softplus", "sigmoid", "silu", "gelu", "gelu_tf")


def _array(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    return tensor.detach().to("cpu", dtype or tensor.dtype).numpy().copy()


def _activation_out(name: str, where: str) -> str:
    if name in ("linear", "none"):
        return "none"
    if name == "gelu_tf":  # the tanh form: DeePMD-kit's "gelu" everywhere (its TensorFlow
        return "gelu"  # "gelu_tf" is tf.nn.gelu, ~1e-9 away from it)
    if name not in _ACTIVATIONS:
        raise MDTrainError(f"{where}: activation {name!r} has no DeePMD-kit equivalent")
    return name


def _layer(layer: torch.nn.Module, activation: str, resnet: bool, trainable: bool) -> dict:
    precision = _PRECISION_NAMES[layer.weight.dtype]
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
            "w": _array(layer.weight),
            "b": _array(layer.bias),
            "idt": None if idt is None else _array(idt),
        },
    }


def _embedding_net(net: torch.nn.Module, neuron: list[int], cfg: dict, act: str) -> dict:
    trainable = bool(cfg["trainable"])
    return {
        "@class": "EmbeddingNetwork",
        "@version": 2,
        "in_dim": 1,
        "neuron": list(neuron),
        "activation_function": act,
        "resnet_dt": bool(cfg["resnet_dt"]),
        "bias": True,
        "precision": _PRECISION_NAMES[net.layers[0].weight.dtype],
        "layers": [_layer(layer, act, True, trainable) for layer in net.layers],
    }


def _fitting_net(net: torch.nn.Module, dim_in: int, cfg: dict, act: str) -> dict:
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
        "precision": _PRECISION_NAMES[out.weight.dtype],
        "bias_out": True,
        "layers": [_layer(layer, act, True, trainable) for layer in hidden]
        + [_layer(out, "none", False, trainable)],
    }


def _collection(networks: list[dict], ndim: int, ntypes: int, kind: str) -> dict:
    return {
        "@class": "NetworkCollection",
        "@version": 1,
        "ndim": ndim,
        "ntypes": ntypes,
        "network_type": kind,
        "networks": networks,
    }


def model_to_deepmd(model: torch.nn.Module) -> dict:
    """DeePMD-kit's ``model`` dict (a "standard" energy model) of an mdtrain EnergyModel."""
    cfg = model.get_model_config()
    dcfg, fcfg = cfg["descriptor"], cfg["fitting_net"]
    desc, fit = model.descriptor, model.fitting
    type_map, ntypes = list(model.type_map), model.ntypes
    dact = _activation_out(dcfg["activation_function"], "model/descriptor")
    fact = _activation_out(fcfg["activation_function"], "model/fitting_net")
    ddtype = desc.dtype
    descriptor = {
        "@class": "Descriptor",
        "type": "se_e2_a",
        "@version": 2,
        "rcut": float(desc.rcut),
        "rcut_smth": float(desc.rcut_smth),
        "sel": list(desc.sel),
        "neuron": [int(n) for n in dcfg["neuron"]],
        "axis_neuron": int(desc.axis_neuron),
        "resnet_dt": bool(dcfg["resnet_dt"]),
        "trainable": bool(dcfg["trainable"]),
        "type_one_side": bool(desc.type_one_side),
        "exclude_types": [list(p) for p in desc.exclude_types],
        "env_protection": float(desc.env_protection),
        "set_davg_zero": bool(desc.set_davg_zero),
        "activation_function": dact,
        "precision": _PRECISION_NAMES[ddtype],
        "spin": None,
        "env_mat": {
            "rcut": float(desc.rcut),
            "rcut_smth": float(desc.rcut_smth),
            "protection": float(desc.env_protection),
            "use_exp_switch": False,
        },
        "embeddings": _collection(
            [_embedding_net(net, dcfg["neuron"], dcfg, dact) for net in desc.networks],
            1 if desc.type_one_side else 2,
            ntypes,
            "embedding_network",
        ),
        "@variables": {"davg": _array(desc.davg, ddtype), "dstd": _array(desc.dstd, ddtype)},
        "type_map": type_map,
    }
    nlayers = len(fcfg["neuron"]) + 1
    fitting = {
        "@class": "Fitting",
        "@version": 4,
        "type": "ener",
        "var_name": "energy",
        "ntypes": ntypes,
        "dim_descrpt": int(fit.dim_in),
        "dim_out": 1,
        "neuron": [int(n) for n in fcfg["neuron"]],
        "resnet_dt": bool(fcfg["resnet_dt"]),
        "numb_fparam": 0,
        "numb_aparam": 0,
        "dim_case_embd": 0,
        "default_fparam": None,
        "rcond": fcfg.get("rcond"),
        "activation_function": fact,
        "precision": _PRECISION_NAMES[fit.dtype],
        "mixed_types": False,
        "exclude_types": [int(t) for t in cfg["atom_exclude_types"]],
        "nets": _collection(
            [_fitting_net(net, int(fit.dim_in), fcfg, fact) for net in fit.networks],
            1,
            ntypes,
            "fitting_network",
        ),
        "@variables": {
            # the energy bias sits here, as in DeePMD-kit's TensorFlow models: its model
            # compression (dp compress) keeps the fitting's bias and drops the model's out_bias
            "bias_atom_e": _array(model.out_bias, torch.float64).reshape(ntypes, 1),
            "case_embd": None,
            "fparam_avg": None,
            "fparam_inv_std": None,
            "aparam_avg": None,
            "aparam_inv_std": None,
        },
        "type_map": type_map,
        "tot_ener_zero": False,
        "trainable": [bool(fcfg["trainable"])] * nlayers,
        "layer_name": None,
        "use_aparam_as_mask": False,
        "spin": None,
        "atom_ener": None,
    }
    return {
        "@class": "Model",
        "type": "standard",
        "@version": 2,
        "type_map": type_map,
        "atom_exclude_types": [int(t) for t in cfg["atom_exclude_types"]],
        "pair_exclude_types": [],
        "rcond": None,
        "preset_out_bias": None,
        "descriptor": descriptor,
        "fitting": fitting,
        "@variables": {
            "out_bias": np.zeros((1, ntypes, 1)),
            # ones: DeePMD-kit's dpmodel/PyTorch energy models never apply out_std, but its
            # TensorFlow backend (the .pb of convert-backend) multiplies atom energies by it
            "out_std": np.ones((1, ntypes, 1)),
        },
    }


def model_def_script(model: torch.nn.Module) -> dict:
    """The ``model`` section of a DeePMD-kit input that builds this architecture (what
    DeePMD-kit stores beside the weights as ``model_def_script``)."""
    cfg = model.get_model_config()
    keys = ("type_map", "descriptor", "fitting_net", "data_stat_nbatch", "atom_exclude_types")
    script = {k: cfg[k] for k in keys}
    for name in ("descriptor", "fitting_net"):
        section = script[name]
        where = f"model/{name}"
        section["activation_function"] = _activation_out(section["activation_function"], where)
    script["fitting_net"].pop("atom_ener", None)
    return script


# -- reading ---------------------------------------------------------------------------------


class _Reader:
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


def _activation_in(r: _Reader, name: Any, where: str) -> str:
    if not isinstance(name, str) or name.lower() not in (*_ACTIVATIONS, "linear", "none"):
        raise r.fail(where, f"activation {name!r} is not supported by mdtrain")
    return name.lower()


def _network_layers(r: _Reader, net: dict, where: str, prefix: str, state: dict) -> list[dict]:
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


def _precision(r: _Reader, value: Any, where: str) -> str:
    if value not in _PRECISIONS:
        raise r.fail(f"{where}/precision", f"{value!r} is not supported by mdtrain")
    return _PRECISIONS[value]


def _descriptor_in(r: _Reader, d: dict, state: dict) -> dict:
    where = "model/descriptor"
    kind = d.get("type")
    if kind not in ("se_e2_a", "se_a"):
        raise r.fail(
            f"{where}/type", f"descriptor {kind!r} is not supported (mdtrain reads se_e2_a)"
        )
    r.off(d, "spin", where, "a spin model")
    env = d.get("env_mat") or {}
    if env.get("use_exp_switch"):
        raise r.fail(f"{where}/env_mat/use_exp_switch", "the exponential switch is not supported")
    ntypes = len(r.get(d, "sel", where))
    type_one_side = bool(d.get("type_one_side", False))
    collection = r.get(d, "embeddings", where)
    nets = r.get(collection, "networks", f"{where}/embeddings")
    expected = ntypes if type_one_side else ntypes * ntypes
    if len(nets) != expected:
        raise r.fail(f"{where}/embeddings", f"{len(nets)} networks, expected {expected}")
    activation = _activation_in(r, d.get("activation_function", "tanh"), where)
    for k, net in enumerate(nets):
        _network_layers(
            r, net, f"{where}/embeddings/networks/{k}", f"descriptor.networks.{k}", state
        )
    variables = r.get(d, "@variables", where)
    nnei = sum(int(s) for s in d["sel"])
    for key in ("davg", "dstd"):
        arr = r.array(variables, key, where).astype(np.float64)
        if arr.size != ntypes * nnei * 4:
            raise r.fail(f"{where}/@variables/{key}", f"shape {arr.shape} does not fit sel")
        state[f"descriptor.{key}"] = torch.from_numpy(arr.reshape(ntypes, nnei, 4))
    return {
        "type": "se_e2_a",
        "sel": [int(s) for s in d["sel"]],
        "rcut": float(r.get(d, "rcut", where)),
        "rcut_smth": float(r.get(d, "rcut_smth", where)),
        "neuron": [int(n) for n in r.get(d, "neuron", where)],
        "axis_neuron": int(r.get(d, "axis_neuron", where)),
        "activation_function": activation,
        "resnet_dt": bool(d.get("resnet_dt", False)),
        "type_one_side": type_one_side,
        "precision": _precision(r, d.get("precision", "float64"), where),
        "trainable": bool(d.get("trainable", True)),
        "exclude_types": [[int(a), int(b)] for a, b in d.get("exclude_types") or []],
        "env_protection": float(d.get("env_protection", 0.0)),
        "set_davg_zero": bool(d.get("set_davg_zero", False)),
        "seed": None,
    }


def _fitting_in(r: _Reader, f: dict, ntypes: int, state: dict) -> tuple[dict, np.ndarray]:
    where = "model/fitting"
    kind = f.get("type", "ener")
    if kind != "ener":
        raise r.fail(f"{where}/type", f"fitting {kind!r} is not supported (mdtrain reads ener)")
    for key, what in (
        ("numb_fparam", "frame parameters (fparam)"),
        ("numb_aparam", "atomic parameters (aparam)"),
        ("dim_case_embd", "a case embedding (multi-task)"),
    ):
        r.off(f, key, where, what, allowed=(0, None))
    for key, what in (
        ("layer_name", "shared fitting layers"),
        ("spin", "a spin model"),
        ("atom_ener", "atom_ener"),
    ):
        r.off(f, key, where, what)
    r.off(f, "mixed_types", where, "one fitting net for all types", allowed=(False, None))
    r.off(f, "use_aparam_as_mask", where, "use_aparam_as_mask", allowed=(False, None))
    nets = r.get(r.get(f, "nets", where), "networks", f"{where}/nets")
    if len(nets) != ntypes:
        raise r.fail(f"{where}/nets", f"{len(nets)} networks, expected {ntypes}")
    activation = _activation_in(r, f.get("activation_function", "tanh"), where)
    for t, net in enumerate(nets):
        layers = _network_layers(
            r, net, f"{where}/nets/networks/{t}", f"fitting.networks.{t}", state
        )
        out = layers[-1]["@variables"]["w"]
        if np.asarray(out).shape[-1] != 1:
            raise r.fail(f"{where}/nets/networks/{t}", "the output layer must have one output")
    variables = f.get("@variables") or {}
    bias = variables.get("bias_atom_e")
    bias = np.zeros(ntypes) if bias is None else np.asarray(bias, dtype=np.float64).reshape(-1)
    trainable = f.get("trainable", True)
    return (
        {
            "type": "ener",
            "neuron": [int(n) for n in r.get(f, "neuron", where)],
            "activation_function": activation,
            "resnet_dt": bool(f.get("resnet_dt", True)),
            "precision": _precision(r, f.get("precision", "float64"), where),
            "trainable": bool(all(trainable) if isinstance(trainable, list) else trainable),
            "rcond": f.get("rcond"),
            "seed": None,
        },
        bias,
    )


def deepmd_to_model(data: dict, source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model_config, state_dict)`` of an mdtrain EnergyModel from a DeePMD file dict
    (the whole file: ``model``, ``model_def_script``, ...); unsupported content is a one-line
    `MDTrainError` naming ``source`` and the key."""
    r = _Reader(source)
    model = r.get(data, "model", "file")
    cls, kind = model.get("@class"), model.get("type", "standard")
    if cls != "Model" or kind != "standard":
        raise r.fail(
            "model", f"a {kind!r} model is not supported (mdtrain reads standard energy models)"
        )
    r.off(model, "pair_exclude_types", "model", "pair_exclude_types")
    r.off(model, "spin", "model", "a spin model")
    type_map = [str(t) for t in r.get(model, "type_map", "model")]
    state: dict[str, torch.Tensor] = {}
    descriptor = _descriptor_in(r, r.get(model, "descriptor", "model"), state)
    ntypes = len(type_map)
    if len(descriptor["sel"]) != ntypes:
        raise r.fail("model/descriptor/sel", f"{len(descriptor['sel'])} entries for {ntypes} types")
    fitting, bias_atom_e = _fitting_in(r, r.get(model, "fitting", "model"), ntypes, state)
    variables = model.get("@variables") or {}
    out_bias = variables.get("out_bias")
    out_bias = np.zeros((1, ntypes, 1)) if out_bias is None else np.asarray(out_bias)
    if out_bias.shape != (1, ntypes, 1):
        raise r.fail(
            "model/@variables/out_bias", f"shape {out_bias.shape}, expected (1, {ntypes}, 1)"
        )
    out_std = variables.get("out_std")
    out_std = np.ones((1, ntypes, 1)) if out_std is None else np.asarray(out_std)
    state["out_bias"] = torch.from_numpy(out_bias.reshape(ntypes) + bias_atom_e)
    state["out_std"] = torch.from_numpy(np.asarray(out_std, dtype=np.float64).reshape(ntypes))
    fit_exclude = model["fitting"].get("exclude_types") or []
    atom_exclude = sorted({int(t) for t in (model.get("atom_exclude_types") or []) + fit_exclude})
    config = {
        "type_map": type_map,
        "descriptor": descriptor,
        "fitting_net": fitting,
        "atom_exclude_types": atom_exclude,
    }
    script = data.get("model_def_script")
    if isinstance(script, dict) and isinstance(script.get("data_stat_nbatch"), int):
        config["data_stat_nbatch"] = script["data_stat_nbatch"]
    try:
        config = normalize_model_config(config)
    except MDTrainError as exc:
        raise MDTrainError(f"{source}: {exc}") from None
    return config, state
