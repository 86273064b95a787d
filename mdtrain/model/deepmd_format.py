"""An mdtrain energy model as DeePMD-kit's serialised model dict, and back.

DeePMD-kit 3.x describes a model backend-independently as nested dicts (``@class``,
``@version``, settings) whose arrays sit under ``@variables`` keys; ``.dp`` files store that
dict (``mdtrain.model.deepmd_file``). Our models have DeePMD-kit's semantics, so the
mapping is one to one: layer ``w``/``b``/``idt`` are our ``weight``/``bias``/``idt``
(``deepmd_nets.py``), each descriptor maps itself (its ``to_deepmd``/``from_deepmd``), and
the energy bias is the atomic model's ``out_bias`` plus the fitting's ``bias_atom_e`` (we
write it as ``bias_atom_e``).
Anything a DeePMD file may hold that this model cannot run is refused by name.
"""

from __future__ import annotations

import numpy as np
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.config import normalize_model_config
from mdtrain.model.deepmd_nets import (
    PRECISION_NAMES,
    Reader,
    activation_in,
    activation_out,
    check_fitting_follows,
    collection_dict,
    fitting_net_dict,
    fitting_networks,
    network_layers,
    param_stats_in,
    param_stats_out,
    precision_in,
    script_activations_out,
    to_numpy,
)
from mdtrain.model.descriptors import DESCRIPTORS, deepmd_descriptor_class


def model_to_deepmd(model: torch.nn.Module) -> dict:
    """DeePMD-kit's ``model`` dict (a "standard" energy model) of an mdtrain EnergyModel."""
    cfg = model.get_model_config()
    dcfg, fcfg = cfg["descriptor"], cfg["fitting_net"]
    desc, fit = model.descriptor, model.fitting
    type_map, ntypes = list(model.type_map), model.ntypes
    fact = activation_out(fcfg["activation_function"], "model/fitting_net")
    descriptor = desc.to_deepmd(dcfg, type_map)
    nlayers = len(fcfg["neuron"]) + 1
    fitting = {
        "@class": "Fitting",
        "@version": 4,
        "type": "ener",
        "var_name": "energy",
        "ntypes": ntypes,
        "dim_descrpt": int(fit.dim_descrpt),
        "dim_out": 1,
        "neuron": [int(n) for n in fcfg["neuron"]],
        "resnet_dt": bool(fcfg["resnet_dt"]),
        "numb_fparam": int(fit.numb_fparam),
        "numb_aparam": int(fit.numb_aparam),
        "dim_case_embd": 0,
        "default_fparam": fcfg["default_fparam"],
        "rcond": fcfg.get("rcond"),
        "activation_function": fact,
        "precision": PRECISION_NAMES[fit.dtype],
        "mixed_types": bool(fit.mixed_types),
        "exclude_types": [int(t) for t in cfg["atom_exclude_types"]],
        "nets": collection_dict(
            [fitting_net_dict(net, int(fit.dim_in), fcfg, fact) for net in fit.networks],
            0 if fit.mixed_types else 1,
            ntypes,
            "fitting_network",
        ),
        "@variables": {
            # the energy bias sits here, as in DeePMD-kit's TensorFlow models: its model
            # compression (dp compress) keeps the fitting's bias and drops the model's out_bias
            "bias_atom_e": to_numpy(model.out_bias, torch.float64).reshape(ntypes, 1),
            "case_embd": None,
            **param_stats_out(fit),
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
    script_activations_out(script)
    script["fitting_net"].pop("atom_ener", None)
    return script


# -- reading ---------------------------------------------------------------------------------


def descriptor_from_deepmd(r: Reader, d: dict, state: dict) -> dict:
    """The ``model.descriptor`` section of DeePMD-kit's descriptor dict ``d`` (any
    registered descriptor); its parameters and buffers go into ``state``."""
    kind = d.get("type")
    cls = deepmd_descriptor_class(kind)
    if cls is None:
        known = ", ".join(t for c in DESCRIPTORS.values() for t in c.deepmd_types)
        raise r.fail(
            "model/descriptor/type", f"descriptor {kind!r} is not supported (mdtrain reads {known})"
        )
    return cls.from_deepmd(r, d, state)


def _fitting_in(r: Reader, f: dict, ntypes: int, state: dict) -> tuple[dict, np.ndarray]:
    where = "model/fitting"
    kind = f.get("type", "ener")
    if kind != "ener":
        raise r.fail(f"{where}/type", f"fitting {kind!r} is not supported (mdtrain reads ener)")
    r.off(f, "dim_case_embd", where, "a case embedding (multi-task)", allowed=(0, None))
    counts = {k: int(f.get(f"numb_{k}") or 0) for k in ("fparam", "aparam")}
    param_stats_in(r, f, counts, state)
    for key, what in (
        ("layer_name", "shared fitting layers"),
        ("spin", "a spin model"),
        ("atom_ener", "atom_ener"),
    ):
        r.off(f, key, where, what)
    r.off(f, "use_aparam_as_mask", where, "use_aparam_as_mask", allowed=(False, None))
    nets = fitting_networks(r, f, ntypes, where)
    activation = activation_in(r, f.get("activation_function", "tanh"), where)
    for t, net in enumerate(nets):
        layers = network_layers(
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
            "precision": precision_in(r, f.get("precision", "float64"), where),
            "trainable": bool(all(trainable) if isinstance(trainable, list) else trainable),
            "rcond": f.get("rcond"),
            "seed": None,
            "numb_fparam": counts["fparam"],
            "numb_aparam": counts["aparam"],
            "default_fparam": f.get("default_fparam"),
        },
        bias,
    )


def deepmd_to_model(data: dict, source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model_config, state_dict)`` of an mdtrain EnergyModel from a DeePMD file dict
    (the whole file: ``model``, ``model_def_script``, ...); unsupported content is a one-line
    `MDTrainError` naming ``source`` and the key."""
    r = Reader(source)
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
    descriptor = descriptor_from_deepmd(r, r.get(model, "descriptor", "model"), state)
    ntypes = len(type_map)
    for k, section in enumerate(descriptor.get("list", [descriptor])):
        if isinstance(section["sel"], list) and len(section["sel"]) != ntypes:
            where = "model/descriptor" + (f"/list/{k}" if "list" in descriptor else "")
            raise r.fail(f"{where}/sel", f"{len(section['sel'])} entries for {ntypes} types")
    check_fitting_follows(r, r.get(model, "fitting", "model"), descriptor)
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
