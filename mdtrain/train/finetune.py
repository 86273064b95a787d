"""Fine-tuning: start training from a pretrained model (an mdtrain checkpoint or a DeePMD-kit
``.dp`` file) on new data whose type_map may differ from the pretrained one. Any descriptor
(a hybrid member by member) and any energy model: a combined model (DP+ZBL, ``linear_ener``)
keeps its structure, each network part mapped as a model of its own
(`mdtrain.train.finetune_map`) and each pair table's columns following the new type_map.

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
from mdtrain.config.model_kind import (
    LINEAR,
    STANDARD,
    model_kind,
    model_type,
    network_sections,
    table_sections,
)
from mdtrain.data.pair_table import table_for_types
from mdtrain.errors import MDTrainError
from mdtrain.model.combined_build import SRTAB_KEYS, TABLE_ROWS
from mdtrain.model.stats import compute_or_load_stats
from mdtrain.neighbors.sel import parse_sel
from mdtrain.train.bias import bias_text, refit_energy_bias
from mdtrain.train.finetune_map import map_biases, map_network, network_parts

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


def _finetune_sel(desc: dict, given: dict, mapping: list[int | None]) -> None:
    """``desc`` (the pretrained section, changed in place) with the sel of the new types:
    the pretrained entries when every type is known to it (the one total of a type-mixed
    list), else the input's (``given``) or "auto", which `pin_pretrained_sel` completes;
    a hybrid member by member, each with its own sel."""
    if "list" in desc:
        members = given.get("list") if isinstance(given.get("list"), list) else []
        for k, member in enumerate(desc["list"]):
            _finetune_sel(member, members[k] if k < len(members) else {}, mapping)
        return
    if mixed_types(desc):
        return
    if all(o is not None for o in mapping):
        desc["sel"] = [desc["sel"][o] for o in mapping]
    else:
        desc["sel"] = given.get("sel", "auto")


def _finetune_exclusions(desc: dict, new_index: dict[int, int]) -> None:
    """``exclude_types`` pairs of types both known, under their new indices (each member's)."""
    for member in desc.get("list") or []:
        _finetune_exclusions(member, new_index)
    if "exclude_types" in desc:
        desc["exclude_types"] = [
            sorted([new_index[a], new_index[b]])
            for a, b in desc["exclude_types"]
            if a in new_index and b in new_index
        ]


def _fresh_settings(section: dict, given: dict) -> None:
    """The input's seeds (fresh nets of new types come from them) and ``trainable``."""
    if "list" in section:  # a hybrid: its members' own
        members = given.get("list") if isinstance(given.get("list"), list) else []
        for k, member in enumerate(section["list"]):
            _fresh_settings(member, members[k] if k < len(members) else {})
        return
    section["seed"] = given.get("seed")
    if "trainable" in given:
        section["trainable"] = given["trainable"]


def _finetune_network(
    target: dict, old: dict, mapping: list[int | None], path: str, where: str
) -> None:
    """``target`` (a standard section of the input, changed in place) with the pretrained
    network ``old``'s descriptor and fitting under the new type indices."""
    for section, keys in _ARCHITECTURE.items():
        given = target.get(section) or {}
        differ = [k for k in keys if k in given and _same(given[k]) != _same(old[section].get(k))]
        if differ:
            log.warning(
                "--finetune: %s.%s %s taken from the pretrained model %s (the input's "
                "differ)", where, section, ", ".join(differ), path,
            )  # fmt: skip
    new_index = {o: n for n, o in enumerate(mapping) if o is not None}
    desc = copy.deepcopy(old["descriptor"])
    fit = copy.deepcopy(old["fitting_net"])
    _fresh_settings(desc, target.get("descriptor") or {})
    _fresh_settings(fit, target.get("fitting_net") or {})
    _finetune_sel(desc, target.get("descriptor") or {}, mapping)
    _finetune_exclusions(desc, new_index)
    if "atom_exclude_types" in old or "atom_exclude_types" in target:
        target["atom_exclude_types"] = sorted(
            new_index[t] for t in old.get("atom_exclude_types", []) if t in new_index
        )
    target["descriptor"], target["fitting_net"] = desc, fit


def _finetune_structure(model: dict, old: dict, path: str) -> None:
    """A combined model's structure from the pretrained one: its parts (``linear_ener``:
    their sections and ``weights``; DP+ZBL: the table and switch settings)."""
    new_map = list(model["type_map"])
    if model_type(old) == LINEAR:
        given = model.get("models") or []
        model["models"] = [
            {**copy.deepcopy(part), "type_map": new_map, **_given_seeds(given, k)}
            for k, part in enumerate(old["models"])
        ]
        if model.get("weights", old.get("weights")) != old.get("weights"):
            log.warning("--finetune: model.weights %s taken from %s", old.get("weights"), path)
        model["weights"] = copy.deepcopy(old.get("weights"))
        return
    for key in (*SRTAB_KEYS, TABLE_ROWS):
        model.pop(key, None)
        if key in old:
            model[key] = copy.deepcopy(old[key])


def _given_seeds(given: list, k: int) -> dict:
    """The input's part k's descriptor and fitting (their seeds and trainable are used)."""
    part = given[k] if k < len(given) and isinstance(given[k], dict) else {}
    return {s: part[s] for s in ("descriptor", "fitting_net") if isinstance(part.get(s), dict)}


def _finetune_tables(model: dict, old: dict, path: str) -> None:
    """Each table of the model: the pretrained one (DeePMD-kit keeps tables in the model's
    state), its columns following the new type_map."""
    pairs = zip(table_sections(model), table_sections(old), strict=True)
    for (where, key, section), (_, _, old_section) in pairs:
        rows = old_section.get(TABLE_ROWS)
        if rows is None:
            continue
        source = old_section.get(key)
        section[key] = source
        section[TABLE_ROWS] = table_for_types(
            np.asarray(rows), list(old["type_map"]), list(model["type_map"]),
            f"--finetune {path}: {where}.{key} (pair table {source})",
        ).tolist()  # fmt: skip


def finetune_config(config: dict, pretrained: dict, path: str) -> dict:
    """The input config with the pretrained model's architecture and the input's type_map:
    each network (`network_parts`) as a standard model's, each table following the
    type_map.

    ``sel``: the pretrained entries when every type is known to it; otherwise the input's
    (a list, or "auto" resolved on the new data), whose known entries `pin_pretrained_sel`
    then replaces.
    """
    config = copy.deepcopy(config)
    old = pretrained["model_config"]
    model = config["model"]
    if model_kind(model) != model_kind(old):
        raise MDTrainError(
            f"--finetune {path}: the pretrained model is a {model_kind(old)} model, the "
            f"input's a {model_kind(model)} model (fine-tuning keeps the pretrained model's "
            "structure; make the input's model section of the same kind)"
        )
    new_map, old_map = list(model["type_map"]), list(old["type_map"])
    mapping = type_mapping(new_map, old_map)
    if all(o is None for o in mapping):
        raise MDTrainError(
            f"--finetune {path}: no element of the input's type_map {new_map} is in the "
            f"pretrained model's {old_map}"
        )
    if model_type(old) != STANDARD or "use_srtab" in old:
        _finetune_structure(model, old, path)
    networks = zip(network_sections(model), network_sections(old), strict=True)
    for (where, section), (_, old_section) in networks:
        _finetune_network(section, old_section, mapping, path, where)
    _finetune_tables(model, old, path)
    new_types = [n for n, o in zip(new_map, mapping, strict=True) if o is None]
    log.info(
        "--finetune %s: type_map %s from %s%s", path, new_map, old_map,
        f"; new types {new_types} start from fresh nets and statistics" if new_types else "",
    )  # fmt: skip
    return config


def _pin_sel(desc: dict, old: dict, mapping: list[int | None]) -> None:
    if "list" in desc:
        for member, old_member in zip(desc["list"], old["list"], strict=True):
            _pin_sel(member, old_member, mapping)
        return
    if mixed_types(desc):  # a type-mixed list: the pretrained total
        desc["sel"] = copy.deepcopy(old["sel"])
        return
    sel = parse_sel(desc["sel"])
    if not isinstance(sel, list):
        raise MDTrainError(f"--finetune: sel {desc['sel']!r} must be resolved first")
    desc["sel"] = [
        int(s) if o is None else int(old["sel"][o]) for s, o in zip(sel, mapping, strict=True)
    ]


def pin_pretrained_sel(config: dict, pretrained: dict) -> dict:
    """``config`` (sel resolved) with the pretrained sel for every type the pretrained model
    knows, in every network and hybrid member: the statistics and the descriptor's
    normalisation by ``sum(sel)`` stay its own."""
    config = copy.deepcopy(config)
    old = pretrained["model_config"]
    mapping = type_mapping(config["model"]["type_map"], old["type_map"])
    networks = zip(network_sections(config["model"]), network_sections(old), strict=True)
    for (_, section), (_, old_section) in networks:
        _pin_sel(section["descriptor"], old_section["descriptor"], mapping)
    return config


def load_pretrained(
    model: torch.nn.Module, pretrained: dict, systems: Sequence[Any], nbatch: int
) -> None:
    """Give ``model`` (built from `finetune_config`) the pretrained weights and statistics of
    known types, fresh statistics of new ones from ``systems``, and the refitted bias."""
    old_config, old_state = pretrained["model_config"], pretrained["model_state"]
    old_map = old_config["type_map"]
    mapping = type_mapping(model.type_map, old_map)
    if any(o is None for o in mapping):  # statistics of new centre types from the data
        compute_or_load_stats(model, systems, None, nbatch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    parts = zip(network_parts(model.get_model_config()), network_parts(old_config), strict=True)
    for (prefix, _), (_, old_part) in parts:
        net = model.get_submodule(prefix.rstrip(".")) if prefix else model
        map_network(state, old_state, prefix, net, old_part, mapping, len(old_map))
    map_biases(state, old_state, mapping)
    model.load_state_dict(state)
    if not refit_energy_bias(model, systems, nbatch):
        log.warning("--finetune: no sampled frame has an energy label: the bias is kept")
        return
    log.info("--finetune: energy bias refitted on the new data: %s", bias_text(model))
