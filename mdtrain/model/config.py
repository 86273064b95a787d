"""Normalise the ``model`` section of input.json for the model builder.

The config loader normally fills defaults already; this repeats DeePMD's argcheck defaults so
that a model can be built from any partial dict (tests, checkpoints of older versions), and
rejects features this trainer does not implement with a one-line error naming the JSON path.
"""

from __future__ import annotations

import copy
from typing import Any

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.registry import descriptor_class
from mdtrain.model.fittings.config import (
    TENSOR_TYPES,
    check_param_keys,
    normalize_tensor_fitting,
)
from mdtrain.model.fittings.invariant_config import INVARIANT_TYPES, normalize_invariant_fitting

FITTING_DEFAULTS: dict[str, Any] = {
    "type": "ener",
    "numb_fparam": 0,
    "numb_aparam": 0,
    "neuron": [120, 120, 120],
    "activation_function": "tanh",
    "precision": "default",
    "resnet_dt": True,
    "trainable": True,
    "rcond": None,
    "seed": None,
    "atom_ener": [],
    "default_fparam": None,
}
MODEL_DEFAULTS: dict[str, Any] = {
    "data_stat_nbatch": 10,
    "data_stat_protect": 1e-2,
    "pair_exclude_types": [],
    "atom_exclude_types": [],
    "preset_out_bias": None,
}
_ALIASES = {"n_axis_neuron": "axis_neuron", "n_neuron": "neuron"}
# An activation name -> the unambiguous name a normalised config stores. In DeePMD-kit's
# PyTorch backend "gelu" is the tanh approximation, the function "gelu_tf" always named.
_ACTIVATION_STORED = {"gelu": "gelu_tf"}
# What a name in a config *stored* by an earlier mdtrain (checkpoint, frozen model) meant, where
# that differs from today: mdtrain's "gelu" was the exact erf form until it followed DeePMD-kit.
# A normalised config never holds these names, so a stored one holding them is an old one.
_ACTIVATION_BEFORE = {"gelu": "gelu_erf"}
_NETWORKS = ("descriptor", "fitting_net")
# Settings accepted only at their default value: key -> value meaning "off".
_UNSUPPORTED = {
    "fitting_net": {
        "atom_ener": [],
        "dim_case_embd": 0,
        "use_aparam_as_mask": False,
    },
    "model": {"pair_exclude_types": [], "preset_out_bias": None},
}


def _fill(section: dict, defaults: dict, where: str) -> dict:
    out = dict(section)
    for alias, name in _ALIASES.items():
        if alias in out:
            if name in out:
                raise MDTrainError(f"{where}: both {alias!r} and its alias target {name!r} given")
            out[name] = out.pop(alias)
    for key, value in defaults.items():
        out.setdefault(key, copy.deepcopy(value))
    return out


def _check_off(section: dict, name: str, where: str) -> None:
    for key, off in _UNSUPPORTED[name].items():
        value = section.get(key, off)
        if value != off and not (off == [] and value in (None, [])):
            raise MDTrainError(f"{where}/{key}: {value!r} is not supported by mdtrain")


def inert_settings(model_config: dict) -> list[str]:
    """One warning per setting of the ``model`` section that is accepted but changes nothing
    here: ``data_stat_protect`` bounds only the fparam/aparam statistics (as in DeePMD-kit; the
    descriptor's dstd floor is a fixed 0.01 in both), so it is inert in a model without them."""
    default = MODEL_DEFAULTS["data_stat_protect"]
    value = model_config.get("data_stat_protect", default)
    fit = model_config.get("fitting_net") or {}
    params = any(int(fit.get(k) or 0) > 0 for k in ("numb_fparam", "numb_aparam"))
    if isinstance(value, (int, float)) and value != default and not params:
        return [
            f"model.data_stat_protect {value:g} has no effect: DeePMD-kit applies it to the "
            "fparam/aparam statistics, and this model has neither (the descriptor's "
            f"dstd floor stays {default:g}, as in DeePMD-kit)"
        ]
    return []


def stored_model_config(model_config: dict) -> dict:
    """A copy of a model config read from a checkpoint or a frozen model, with the names whose
    meaning changed since it was written replaced by the function it was trained with (an old
    ``"gelu"`` becomes ``"gelu_erf"``), so that the model keeps giving the same energies."""
    if not isinstance(model_config, dict):
        return model_config
    cfg = copy.deepcopy(model_config)
    for name in _NETWORKS:
        section = cfg.get(name)
        if isinstance(section, dict):
            act = section.get("activation_function")
            if isinstance(act, str) and act in _ACTIVATION_BEFORE:
                section["activation_function"] = _ACTIVATION_BEFORE[act]
    return cfg


def _store_activation(section: dict) -> None:
    act = section["activation_function"]
    if isinstance(act, str):
        section["activation_function"] = _ACTIVATION_STORED.get(act, act)


def _normalize_descriptor(given: Any, ntypes: int, where: str) -> dict:
    """A filled, checked descriptor section; a hybrid's members each in turn (``where``
    ``model/descriptor/list[k]``)."""
    if not isinstance(given, dict):
        raise MDTrainError(f"{where}: expected a JSON object")
    desc_cls = descriptor_class(given.get("type", "se_e2_a"), where)
    desc = _fill(given, desc_cls.defaults, where)
    desc["type"] = desc_cls.type_name
    if desc_cls.members_key is not None:
        desc_cls.check_config(desc, ntypes, where)
        key = desc_cls.members_key
        desc[key] = [
            _normalize_descriptor(m, ntypes, f"{where}/{key}[{k}]") for k, m in enumerate(desc[key])
        ]
        return desc
    sel = desc.get("sel")
    if getattr(desc_cls, "mixed_types", False) and isinstance(sel, int):
        sel = desc["sel"] = [sel]  # one total for all types, kept as [total] like the lists
    if not isinstance(sel, list):
        raise MDTrainError(
            f"{where}/sel: {sel!r} must be resolved to a list before building the model"
        )
    desc_cls.check_sel(sel, ntypes, f"{where}/sel")
    if getattr(desc_cls, "mixed_types", False):
        desc["sel"] = [sum(sel)]  # DeePMD-kit: only the sum of a list matters
    desc_cls.check_config(desc, ntypes, where)
    for pair in desc["exclude_types"]:
        if len(pair) != 2 or not all(0 <= int(t) < ntypes for t in pair):
            raise MDTrainError(f"{where}/exclude_types: bad pair {pair!r}")
    _store_activation(desc)
    return desc


def normalize_model_config(model_config: dict) -> dict:
    """A full copy of the ``model`` section with defaults filled and values checked."""
    if not isinstance(model_config, dict):
        raise MDTrainError("model: expected a JSON object")
    cfg = _fill(model_config, MODEL_DEFAULTS, "model")
    type_map = cfg.get("type_map")
    if (
        not isinstance(type_map, list)
        or not type_map
        or not all(isinstance(t, str) for t in type_map)
    ):
        raise MDTrainError("model/type_map: a non-empty list of element names is required")
    ntypes = len(type_map)
    desc = _normalize_descriptor(cfg.get("descriptor") or {}, ntypes, "model/descriptor")
    fit_in = cfg.get("fitting_net") or {}
    if fit_in.get("type") in TENSOR_TYPES:
        fit = normalize_tensor_fitting(fit_in, ntypes)
    elif fit_in.get("type") in INVARIANT_TYPES:
        fit = normalize_invariant_fitting(fit_in)
    else:
        fit = _fill(fit_in, FITTING_DEFAULTS, "model/fitting_net")
    if fit["type"] not in ("ener", *TENSOR_TYPES, *INVARIANT_TYPES):
        raise MDTrainError(
            f"model/fitting_net/type: {fit['type']!r} is not supported "
            "(ener, dipole, polar, dos, property)"
        )
    for t in cfg["atom_exclude_types"]:
        if not 0 <= int(t) < ntypes:
            raise MDTrainError(f"model/atom_exclude_types: type {t!r} out of range")
    if isinstance(fit.get("trainable", True), list):
        raise MDTrainError("model/fitting_net/trainable: only true/false is supported")
    _store_activation(fit)
    if fit["type"] == "ener":
        _check_off(fit, "fitting_net", "model/fitting_net")
        check_param_keys(fit, "model/fitting_net")
    _check_off(cfg, "model", "model")
    cfg["descriptor"] = desc
    cfg["fitting_net"] = fit
    return cfg
