"""Fine-tuning: start training from a pretrained model (an mdtrain checkpoint or a DeePMD-kit
``.dp`` file) on new data whose type_map may differ from the pretrained one.

The architecture (descriptor and fitting settings) is the pretrained model's; the type_map is
the input's, matched to the pretrained one by element name. A type present in both keeps its
fitting net (after a type-mixed descriptor the one net shared by all types is kept), its
embedding nets (with ``type_one_side`` false, those of pairs of two such
types), its ``sel`` and its descriptor statistics; a new type gets fresh nets (from the
input's seeds) and statistics from the new data. The energy bias is then refitted on the new
data as DeePMD-kit's ``change-by-statistic`` does: the least-squares per-type correction of
``label − prediction`` is added to the bias.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mdtrain.config.mixed_types import mixed_types
from mdtrain.config.model_kind import standard_only
from mdtrain.errors import MDTrainError
from mdtrain.model.stats import compute_or_load_stats
from mdtrain.neighbors.sel import parse_sel
from mdtrain.train.bias import bias_text, refit_energy_bias

log = logging.getLogger("mdtrain")

# Descriptor/fitting settings that fix the weights' meaning: the pretrained model's are used.
_ARCHITECTURE = {
    "descriptor": (
        "type", "rcut", "rcut_smth", "neuron", "axis_neuron", "type_one_side", "resnet_dt",
        "activation_function", "precision", "env_protection", "set_davg_zero",
    ),
    "fitting_net": ("neuron", "resnet_dt", "activation_function", "precision"),
}  # fmt: skip


def _same(value: Any) -> Any:
    """A setting as compared with the pretrained one: names of the same thing made equal."""
    return (
        {"default": "float64", "gelu": "gelu_tf"}.get(value, value)
        if isinstance(value, str)
        else value
    )


def type_mapping(new_map: Sequence[str], old_map: Sequence[str]) -> list[int | None]:
    """For each new type, its index in the pretrained type_map (None: a new element)."""
    return [list(old_map).index(name) if name in old_map else None for name in new_map]


def finetune_config(config: dict, pretrained: dict, path: str) -> dict:
    """The input config with the pretrained model's architecture and the input's type_map.

    ``sel``: the pretrained entries when every type is known to it; otherwise the input's
    (a list, or "auto" resolved on the new data), whose known entries `pin_pretrained_sel`
    then replaces.
    """
    config = copy.deepcopy(config)
    old = pretrained["model_config"]
    model = config["model"]
    why = "mdtrain fine-tunes standard models only; start from it with --init-model"
    standard_only(model, f"--finetune {path} ({why})")
    standard_only(old, f"--finetune {path} ({why})")
    new_map, old_map = list(model["type_map"]), list(old["type_map"])
    if "list" in old["descriptor"]:
        raise MDTrainError(f"--finetune {path}: a hybrid descriptor cannot be fine-tuned yet")
    mapping = type_mapping(new_map, old_map)
    if all(o is None for o in mapping):
        raise MDTrainError(
            f"--finetune {path}: no element of the input's type_map {new_map} is in the "
            f"pretrained model's {old_map}"
        )
    for section, keys in _ARCHITECTURE.items():
        given = model.get(section) or {}
        differ = [k for k in keys if k in given and _same(given[k]) != _same(old[section].get(k))]
        if differ:
            log.warning(
                "--finetune: model.%s %s taken from the pretrained model %s (the input's "
                "differ)", section, ", ".join(differ), path,
            )  # fmt: skip
    new_index = {o: n for n, o in enumerate(mapping) if o is not None}
    desc = copy.deepcopy(old["descriptor"])
    fit = copy.deepcopy(old["fitting_net"])
    for section, fresh in (
        (desc, model.get("descriptor") or {}),
        (fit, model.get("fitting_net") or {}),
    ):
        section["seed"] = fresh.get("seed")  # fresh nets of new types come from the input's seeds
        section["trainable"] = fresh.get("trainable", section.get("trainable", True))
    if mixed_types(desc):  # one total for all types: the pretrained one
        desc["sel"] = list(old["descriptor"]["sel"])
    elif all(o is not None for o in mapping):
        desc["sel"] = [old["descriptor"]["sel"][o] for o in mapping]
    else:
        desc["sel"] = (model.get("descriptor") or {}).get("sel", "auto")
    desc["exclude_types"] = [
        sorted([new_index[a], new_index[b]])
        for a, b in old["descriptor"]["exclude_types"]
        if a in new_index and b in new_index
    ]
    model["atom_exclude_types"] = sorted(
        new_index[t] for t in old.get("atom_exclude_types", []) if t in new_index
    )
    model["descriptor"], model["fitting_net"] = desc, fit
    new_types = [n for n, o in zip(new_map, mapping, strict=True) if o is None]
    log.info(
        "--finetune %s: type_map %s from %s%s", path, new_map, old_map,
        f"; new types {new_types} start from fresh nets and statistics" if new_types else "",
    )  # fmt: skip
    return config


def pin_pretrained_sel(config: dict, pretrained: dict) -> dict:
    """``config`` (sel resolved) with the pretrained sel for every type the pretrained model
    knows: the statistics and the descriptor's normalisation by ``sum(sel)`` stay its own."""
    config = copy.deepcopy(config)
    desc = config["model"]["descriptor"]
    old = pretrained["model_config"]
    mapping = type_mapping(config["model"]["type_map"], old["type_map"])
    sel = parse_sel(desc["sel"])
    if mixed_types(desc):  # a type-mixed list: the pretrained total
        desc["sel"] = list(old["descriptor"]["sel"])
        return config
    if not isinstance(sel, list):
        raise MDTrainError(f"--finetune: sel {desc['sel']!r} must be resolved first")
    desc["sel"] = [
        int(s) if o is None else int(old["descriptor"]["sel"][o])
        for s, o in zip(sel, mapping, strict=True)
    ]
    return config


def _copy_net(target: dict, source: dict, new_prefix: str, old_prefix: str) -> None:
    for key in [k for k in target if k.startswith(new_prefix + ".")]:
        target[key] = source[old_prefix + key[len(new_prefix) :]].clone()


def _mapped_weights(model: torch.nn.Module, pretrained: dict, mapping: list) -> dict:
    """The model's state dict with the pretrained nets of known types copied in."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    old_state = pretrained["model_state"]
    n_new, n_old = len(mapping), len(pretrained["model_config"]["type_map"])
    if model.descriptor.mixed_types:
        _mapped_type_embedding(state, old_state, mapping)
        pairs = []
    elif model.descriptor.type_one_side:
        pairs = [(t, o) for t, o in enumerate(mapping) if o is not None]
    else:
        pairs = [
            (c + t * n_new, oc + ot * n_old)
            for c, oc in enumerate(mapping)
            for t, ot in enumerate(mapping)
            if oc is not None and ot is not None
        ]
    for new, old in pairs:
        _copy_net(state, old_state, f"descriptor.networks.{new}", f"descriptor.networks.{old}")
    if model.fitting.mixed_types:  # one net for all types: the pretrained one as it is
        if any(o is not None for o in mapping):
            _copy_net(state, old_state, "fitting.networks.0", "fitting.networks.0")
        return state
    for t, o in enumerate(mapping):
        if o is not None:
            _copy_net(state, old_state, f"fitting.networks.{t}", f"fitting.networks.{o}")
    return state


def _mapped_type_embedding(state: dict, old_state: dict, mapping: list) -> None:
    """A type-embedding descriptor: its nets are shared by all types, so every descriptor
    parameter is the pretrained one, except the rows of the type embedding's first layer
    (one per type, from a one-hot input) of types new to it, which stay fresh."""
    rows = "descriptor.type_embedding.net.layers.0.weight"
    for key in [k for k in state if k.startswith("descriptor.")]:
        if key in ("descriptor.davg", "descriptor.dstd") or key not in old_state:
            continue
        if key != rows:
            state[key] = old_state[key].clone()
            continue
        for t, o in enumerate(mapping):
            if o is not None:
                state[key][t] = old_state[key][o]


def _mapped_stats(
    state: dict, pretrained: dict, mapping: list, new_sel: list[int], mixed: bool = False
) -> None:
    """davg/dstd rows of known centre types from the pretrained model, neighbour block by
    neighbour block (a block of a type new to it takes the row's first value: the
    statistics are per centre type)."""
    old_state, old_sel = pretrained["model_state"], pretrained["model_config"]["descriptor"]["sel"]
    if mixed:  # a type-mixed list: whole rows per centre type
        for key in ("descriptor.davg", "descriptor.dstd"):
            for c, oc in enumerate(mapping):
                if oc is not None:
                    state[key][c] = old_state[key][oc].to(torch.float64)
        return
    old_off = np.concatenate([[0], np.cumsum(old_sel)]).astype(int)
    new_off = np.concatenate([[0], np.cumsum(new_sel)]).astype(int)
    for key in ("descriptor.davg", "descriptor.dstd"):
        old, new = old_state[key].to(torch.float64), state[key]
        for c, oc in enumerate(mapping):
            if oc is None:
                continue
            for t, ot in enumerate(mapping):
                row = old[oc, old_off[ot]] if ot is not None and old_sel[ot] else old[oc, 0]
                new[c, new_off[t] : new_off[t + 1]] = row


def load_pretrained(
    model: torch.nn.Module, pretrained: dict, systems: Sequence[Any], nbatch: int
) -> None:
    """Give ``model`` (built from `finetune_config`) the pretrained weights and statistics of
    known types, fresh statistics of new ones from ``systems``, and the refitted bias."""
    old_map = pretrained["model_config"]["type_map"]
    mapping = type_mapping(model.type_map, old_map)
    if any(o is None for o in mapping):  # statistics of new centre types from the data
        compute_or_load_stats(model, systems, None, nbatch)
    state = _mapped_weights(model, pretrained, mapping)
    _mapped_stats(state, pretrained, mapping, list(model.sel), model.descriptor.mixed_types)
    old_bias = pretrained["model_state"]["out_bias"].to(torch.float64)
    old_std = pretrained["model_state"]["out_std"].to(torch.float64)
    state["out_bias"] = torch.tensor([0.0 if o is None else float(old_bias[o]) for o in mapping])
    state["out_std"] = torch.tensor([1.0 if o is None else float(old_std[o]) for o in mapping])
    model.load_state_dict(state)
    if not refit_energy_bias(model, systems, nbatch):
        log.warning("--finetune: no sampled frame has an energy label: the bias is kept")
        return
    log.info("--finetune: energy bias refitted on the new data: %s", bias_text(model))
