"""The ``fitting_net`` section of a dipole or polar model: DeePMD-kit 3.2's keys and defaults
(``deepmd/utils/argcheck.py``: ``fitting_dipole``, ``fitting_polar``), checked with one-line
errors naming the JSON path.

``sel_type`` (aliases ``dipole_type``/``pol_type``) names the types that carry an atomic
tensor, as DeePMD-kit's TensorFlow backend defines it; the other types are excluded like
``atom_exclude_types`` (which DeePMD-kit's PyTorch backend uses instead). ``embedding_width``
is not an input key in DeePMD-kit: it is the descriptor's ``neuron[-1]``.
"""

from __future__ import annotations

import copy
from typing import Any

from mdtrain.errors import MDTrainError

TENSOR_TYPES = ("dipole", "polar")
TENSOR_DEFAULTS: dict[str, Any] = {
    "numb_fparam": 0,
    "numb_aparam": 0,
    "default_fparam": None,
    "dim_case_embd": 0,
    "neuron": [120, 120, 120],
    "activation_function": "tanh",
    "resnet_dt": True,
    "precision": "default",
    "sel_type": None,
    "seed": None,
}
POLAR_DEFAULTS: dict[str, Any] = {"fit_diag": True, "scale": 1.0, "shift_diag": True}
_ALIASES = {"n_neuron": "neuron", "dipole_type": "sel_type", "pol_type": "sel_type"}
# accepted only at the value that means "off"
_OFF = {"numb_fparam": 0, "numb_aparam": 0, "default_fparam": None, "dim_case_embd": 0}


def fill_fitting(
    fit: dict,
    defaults: dict,
    extra: tuple[str, ...] = (),
    where: str = "model/fitting_net",
    params: bool = False,
) -> dict:
    """A copy of a ``fitting_net`` section with its aliases resolved and ``defaults`` filled;
    a key neither there nor in ``extra``, or a frame/atomic-parameter key away from its "off"
    value, is one line naming it. With ``params`` (the DOS and property fittings) the
    frame/atomic-parameter keys may be on, checked by `check_param_keys`."""
    out = dict(fit)
    for alias, name in _ALIASES.items():
        if alias in out and name in defaults:
            if name in out:
                raise MDTrainError(f"{where}: both {alias!r} and {name!r} given")
            out[name] = out.pop(alias)
    for key, value in defaults.items():
        out.setdefault(key, copy.deepcopy(value))
    unknown = sorted(set(out) - {"type", *defaults, *extra})
    if unknown:
        raise MDTrainError(f"{where}/{unknown[0]}: not a key of a {out.get('type')} fitting")
    if params:
        check_param_keys(out, where)
    for key, off in _OFF.items():
        if params and key != "dim_case_embd":
            continue
        if out[key] != off:
            raise MDTrainError(f"{where}/{key}: {out[key]!r} is not supported by mdtrain")
    return out


def check_param_keys(fit: dict, where: str) -> None:
    """numb_fparam/numb_aparam are counts; default_fparam has numb_fparam values."""
    for key in ("numb_fparam", "numb_aparam"):
        value = fit[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MDTrainError(f"{where}/{key}: {value!r} must be a non-negative integer")
    default = fit["default_fparam"]
    if default is None:
        return
    if not isinstance(default, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in default
    ):
        raise MDTrainError(f"{where}/default_fparam: {default!r} must be a list of numbers")
    if len(default) != fit["numb_fparam"]:
        raise MDTrainError(
            f"{where}/default_fparam: {len(default)} values but numb_fparam is {fit['numb_fparam']}"
        )


def normalize_tensor_fitting(fit: dict, ntypes: int, where: str = "model/fitting_net") -> dict:
    """A full copy of a dipole/polar ``fitting_net``: defaults filled, aliases resolved,
    ``sel_type`` a sorted list of types (all types when absent), ``scale`` one value per
    type."""
    kind = fit.get("type")
    if kind not in TENSOR_TYPES:
        raise MDTrainError(f"{where}/type: {kind!r} is not a tensor fitting {TENSOR_TYPES}")
    defaults = {**TENSOR_DEFAULTS, **(POLAR_DEFAULTS if kind == "polar" else {})}
    out = fill_fitting(fit, defaults, ("embedding_width", "trainable", "rcond"), where)
    sel = out["sel_type"]
    if sel is None:
        sel = list(range(ntypes))
    elif isinstance(sel, int) and not isinstance(sel, bool):
        sel = [sel]
    if not isinstance(sel, list) or not all(isinstance(t, int) and 0 <= t < ntypes for t in sel):
        raise MDTrainError(
            f"{where}/sel_type: {out['sel_type']!r} is not a list of types 0..{ntypes - 1}"
        )
    out["sel_type"] = sorted(set(sel))
    if kind == "polar":
        scale = out["scale"]
        if isinstance(scale, int | float) and not isinstance(scale, bool):
            scale = [float(scale)] * ntypes
        if not isinstance(scale, list) or len(scale) != ntypes:
            raise MDTrainError(
                f"{where}/scale: {out['scale']!r}: one number or one per type ({ntypes})"
            )
        out["scale"] = [float(s) for s in scale]
    return out


def excluded_types(model_cfg: dict) -> list[int]:
    """The atom types whose atomic tensor is zero: ``atom_exclude_types`` and the types
    outside the fitting's ``sel_type``."""
    ntypes = len(model_cfg["type_map"])
    sel = set(model_cfg["fitting_net"].get("sel_type") or range(ntypes))
    off = {int(t) for t in model_cfg.get("atom_exclude_types") or []}
    return sorted(off | (set(range(ntypes)) - sel))
