"""The ``fitting_net`` section of a DOS or property model: DeePMD-kit 3.2's keys and defaults
(``deepmd/utils/argcheck.py``: ``fitting_dos``, ``fitting_property``), checked with one-line
errors naming the JSON path. Frame and atomic parameters and case embeddings are accepted at
their "off" values only.
"""

from __future__ import annotations

import copy
from typing import Any

from mdtrain.data.labels import output_labels
from mdtrain.errors import MDTrainError

INVARIANT_TYPES = ("dos", "property")
_COMMON: dict[str, Any] = {
    "numb_fparam": 0,
    "numb_aparam": 0,
    "default_fparam": None,
    "dim_case_embd": 0,
    "neuron": [120, 120, 120],
    "activation_function": "tanh",
    "resnet_dt": True,
    "trainable": True,
    "seed": None,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "dos": {**_COMMON, "precision": "float64", "rcond": None, "numb_dos": 300},
    "property": {
        **_COMMON,
        "precision": "default",
        "task_dim": 1,
        "intensive": False,
        "distinguish_types": True,
    },
}
_ALIASES = {"n_neuron": "neuron"}
_OFF = {"numb_fparam": 0, "numb_aparam": 0, "default_fparam": None, "dim_case_embd": 0}


def normalize_invariant_fitting(fit: dict, where: str = "model/fitting_net") -> dict:
    """A full copy of a ``dos``/``property`` ``fitting_net``: defaults filled, aliases
    resolved, values checked (``property_name`` is required)."""
    out = dict(fit)
    kind = out.get("type")
    if kind not in INVARIANT_TYPES:
        raise MDTrainError(f"{where}/type: {kind!r} is not one of {INVARIANT_TYPES}")
    for alias, name in _ALIASES.items():
        if alias in out:
            if name in out:
                raise MDTrainError(f"{where}: both {alias!r} and {name!r} given")
            out[name] = out.pop(alias)
    defaults = DEFAULTS[kind]
    for key, value in defaults.items():
        out.setdefault(key, copy.deepcopy(value))
    allowed = {"type", *defaults, *(("property_name",) if kind == "property" else ())}
    unknown = sorted(set(out) - allowed)
    if unknown:
        raise MDTrainError(f"{where}/{unknown[0]}: not a key of a {kind} fitting")
    for key, off in _OFF.items():
        if out[key] != off:
            raise MDTrainError(f"{where}/{key}: {out[key]!r} is not supported by mdtrain")
    if not isinstance(out["trainable"], bool):
        raise MDTrainError(f"{where}/trainable: only true/false is supported")
    for key in ("intensive", "distinguish_types"):
        if key in out and not isinstance(out[key], bool):
            raise MDTrainError(f"{where}/{key}: {out[key]!r} must be true or false")
    output_labels({"fitting_net": out})  # numb_dos, task_dim, property_name checked
    return out


def output_width(fit: dict) -> int:
    """Values per atom and frame: ``numb_dos`` or ``task_dim``."""
    return int(fit["numb_dos"] if fit["type"] == "dos" else fit["task_dim"])


def output_name(fit: dict) -> str:
    """The output's (and its label file's) name: ``dos`` or the ``property_name``."""
    return "dos" if fit["type"] == "dos" else str(fit["property_name"])
