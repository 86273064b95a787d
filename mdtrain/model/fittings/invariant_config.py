"""The ``fitting_net`` section of a DOS or property model: DeePMD-kit 3.2's keys and defaults
(``deepmd/utils/argcheck.py``: ``fitting_dos``, ``fitting_property``), checked with one-line
errors naming the JSON path. Frame and atomic parameters (``numb_fparam``, ``numb_aparam``,
``default_fparam``) as for the energy fitting; case embeddings at their "off" value only.
"""

from __future__ import annotations

from typing import Any

from mdtrain.data.labels import output_labels
from mdtrain.errors import MDTrainError
from mdtrain.model.fittings.config import TENSOR_DEFAULTS, fill_fitting

INVARIANT_TYPES = ("dos", "property")
# the keys DOS and property fittings share with the tensor ones (DeePMD-kit's argcheck)
_COMMON = {k: v for k, v in TENSOR_DEFAULTS.items() if k not in ("sel_type", "precision")}
DEFAULTS: dict[str, dict[str, Any]] = {
    "dos": {**_COMMON, "trainable": True, "precision": "float64", "rcond": None, "numb_dos": 300},
    "property": {
        **_COMMON,
        "trainable": True,
        "precision": "default",
        "task_dim": 1,
        "intensive": False,
        "distinguish_types": True,
    },
}


def normalize_invariant_fitting(fit: dict, where: str = "model/fitting_net") -> dict:
    """A full copy of a ``dos``/``property`` ``fitting_net``: defaults filled, aliases
    resolved, values checked (``property_name`` is required)."""
    kind = fit.get("type")
    if kind not in INVARIANT_TYPES:
        raise MDTrainError(f"{where}/type: {kind!r} is not one of {INVARIANT_TYPES}")
    extra = ("property_name",) if kind == "property" else ()
    out = fill_fitting(fit, DEFAULTS[kind], extra, where, params=True)
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
