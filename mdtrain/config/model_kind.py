"""Which kind of model a ``model`` section is, and where its networks and tables are.

DeePMD-kit's ``model.type``: ``standard`` (a descriptor and a fitting net, the default; with
``use_srtab`` the DP+ZBL model), ``linear_ener`` (``models`` combined with ``weights``) and
``pairtab`` (a table alone). Code that reads a network's settings from the config (checks,
precision, neighbour statistics) walks `network_sections`; code that reads table files walks
`table_sections`, so that a part of a ``linear_ener`` model is treated like a model of its
own, named by its JSON path (``model.models[1]``).
"""

from __future__ import annotations

import json
from typing import Any

STANDARD, LINEAR, PAIRTAB = "standard", "linear_ener", "pairtab"


def model_type(model: Any) -> str | None:
    """``standard``, ``linear_ener``, ``pairtab`` (or another string given); None when
    ``model`` is not an object."""
    if not isinstance(model, dict):
        return None
    kind = model.get("type", STANDARD)
    return kind if isinstance(kind, str) else None


def parts(model: Any, where: str = "model") -> list[tuple[str, dict]]:
    """``(JSON path, section)`` of each model a section stands for: itself, or each object of
    a ``linear_ener`` model's ``models``."""
    if model_type(model) != LINEAR:
        return [(where, model)] if isinstance(model, dict) else []
    subs = model.get("models")
    subs = subs if isinstance(subs, list) else []
    return [(f"{where}.models[{k}]", m) for k, m in enumerate(subs) if isinstance(m, dict)]


def model_kind(model: Any) -> str:
    """The structure of a model section, in words: ``standard``, ``DP+ZBL``, ``pairtab``, or
    ``linear_ener`` with its parts' kinds (``linear_ener [standard, pairtab]``); two models
    of one kind have their weights and tables in the same places."""
    kind = model_type(model)
    if kind == LINEAR:
        return f"{LINEAR} [{', '.join(model_kind(m) for _, m in parts(model))}]"
    if kind == STANDARD and isinstance(model, dict) and "use_srtab" in model:
        return "DP+ZBL"
    return str(kind)


def network_sections(model: Any, where: str = "model") -> list[tuple[str, dict]]:
    """``(JSON path, section)`` of each standard model (a descriptor and a fitting net)."""
    return [(w, m) for w, m in parts(model, where) if model_type(m) == STANDARD]


def table_sections(model: Any, where: str = "model") -> list[tuple[str, str, dict]]:
    """``(JSON path, key, section)`` of each table file a section names: ``use_srtab`` of a
    standard model, ``tab_file`` of a ``pairtab`` model or part."""
    found = []
    for w, m in parts(model, where):
        if model_type(m) == PAIRTAB:
            found.append((w, "tab_file", m))
        elif model_type(m) == STANDARD and "use_srtab" in m:
            found.append((w, "use_srtab", m))
    return found


def linear_problems(model: Any) -> list[str]:
    """A ``pairtab`` model alone (nothing to train); what a ``linear_ener`` model may not hold in DeePMD-kit 3.2 or in mdtrain: ``weights``
    of another length than ``models``, a part of another kind than a standard energy model
    (without ``use_srtab``) or a ``pairtab`` model, a part's own ``type_map`` that differs."""
    if model_type(model) == PAIRTAB:
        return [
            "model.type: a pairtab model alone has no weights to train (DeePMD-kit's PyTorch "
            "backend has no such model either); make it a part of a linear_ener model"
        ]
    if model_type(model) != LINEAR:
        return []
    subs = model.get("models")
    weights = model.get("weights")
    problems = []
    if isinstance(subs, list) and isinstance(weights, list) and len(weights) != len(subs):
        problems.append(
            f"model.weights: {len(weights)} weights for {len(subs)} models (one per entry of "
            "model.models)"
        )
    type_map = model.get("type_map")
    for where, sub in parts(model):
        kind = model_type(sub)
        if kind not in (STANDARD, PAIRTAB):
            continue  # the schema names the types a part may have
        if kind == STANDARD and "use_srtab" in sub:
            problems.append(
                f"{where}.use_srtab: a DP+ZBL model cannot be a part of a linear_ener model "
                "(add the table as a pairtab part)"
            )
        fit = sub.get("fitting_net")
        if kind == STANDARD and isinstance(fit, dict) and fit.get("type", "ener") != "ener":
            problems.append(f"{where}.fitting_net.type: a linear_ener part fits energies (ener)")
        own = sub.get("type_map")
        if own is not None and isinstance(type_map, list) and own != type_map:
            problems.append(f"{where}.type_map: must be model.type_map {type_map} in mdtrain")
    return problems + _param_problems(model)


def _param_problems(model: dict) -> list[str]:
    """The network parts that take frame/atomic parameters must take the same ones: every
    part is given the same ``fparam``/``aparam`` (as in DeePMD-kit's linear model)."""
    problems = []
    for key in ("numb_fparam", "numb_aparam", "default_fparam"):
        seen = {}
        for where, sub in network_sections(model):
            fit = sub.get("fitting_net")
            value = fit.get(key) if isinstance(fit, dict) else None
            if value not in (None, 0):
                seen.setdefault(json.dumps(value), where)
        if len(seen) > 1:
            problems.append(
                f"model.models: {key} differs between {' and '.join(seen.values())}; the parts "
                "are given the same frame/atomic parameters"
            )
    return problems
