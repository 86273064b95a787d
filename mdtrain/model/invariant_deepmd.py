"""An `InvariantModel` (DOS, property) as DeePMD-kit's serialised model dict (a "standard"
model whose fitting is ``dos`` or ``property``), and back: what ``.dp`` files of DeePMD-kit's
``DeepDOS`` / ``DeepProperty`` models hold. The descriptor part is each descriptor's own
(`mdtrain.model.deepmd_format`), the fitting part `mdtrain.model.fittings.invariant_io`'s,
and the atomic model's ``out_bias``/``out_std`` (1, ntypes, k) our buffers of those names.
"""

from __future__ import annotations

import numpy as np
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.config import normalize_model_config
from mdtrain.model.deepmd_format import descriptor_from_deepmd
from mdtrain.model.deepmd_nets import Reader, activation_out
from mdtrain.model.fittings.invariant_config import INVARIANT_TYPES
from mdtrain.model.fittings.invariant_io import (
    invariant_fitting_from_deepmd,
    invariant_fitting_to_deepmd,
)
from mdtrain.model.invariant import InvariantModel


def is_invariant_deepmd(data: dict) -> bool:
    """True for a DeePMD-kit file dict whose model fits a DOS or a property."""
    fitting = (data.get("model") or {}).get("fitting") or {}
    return fitting.get("type") in INVARIANT_TYPES


def invariant_model_to_deepmd(model: InvariantModel) -> dict:
    """DeePMD-kit's ``model`` dict of ``model``."""
    cfg = model.get_model_config()
    type_map, ntypes, width = list(model.type_map), model.ntypes, model.width
    act = activation_out(cfg["fitting_net"]["activation_function"], "model/fitting_net")

    def stat(buffer: torch.Tensor) -> np.ndarray:
        return buffer.detach().cpu().numpy().reshape(1, ntypes, width).copy()

    return {
        "@class": "Model",
        "type": "standard",
        "@version": 2,
        "type_map": type_map,
        "atom_exclude_types": list(model.excluded),
        "pair_exclude_types": [],
        "rcond": None,
        "preset_out_bias": None,
        "descriptor": model.descriptor.to_deepmd(cfg["descriptor"], type_map),
        "fitting": invariant_fitting_to_deepmd(
            model.fitting, cfg["fitting_net"], type_map, act, model.excluded
        ),
        "@variables": {"out_bias": stat(model.out_bias), "out_std": stat(model.out_std)},
    }


def invariant_def_script(model: InvariantModel) -> dict:
    """The ``model`` section of a DeePMD-kit input that builds this architecture (stored as
    ``model_def_script``)."""
    cfg = model.get_model_config()
    script = {
        "type_map": cfg["type_map"],
        "descriptor": dict(cfg["descriptor"]),
        "fitting_net": dict(cfg["fitting_net"]),
        "atom_exclude_types": list(model.excluded),
        "data_stat_nbatch": cfg["data_stat_nbatch"],
    }
    for name in ("descriptor", "fitting_net"):
        section = script[name]
        section["activation_function"] = activation_out(
            section["activation_function"], f"model/{name}"
        )
    return script


def invariant_model_from_deepmd(data: dict, source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model_config, state_dict)`` of an `InvariantModel` from a DeePMD-kit file dict."""
    r = Reader(source)
    model = r.get(data, "model", "file")
    if model.get("@class") != "Model" or model.get("type", "standard") != "standard":
        raise r.fail("model", "not a standard DeePMD-kit model")
    r.off(model, "pair_exclude_types", "model", "pair_exclude_types")
    type_map = [str(t) for t in r.get(model, "type_map", "model")]
    ntypes = len(type_map)
    state: dict[str, torch.Tensor] = {}
    descriptor = descriptor_from_deepmd(r, r.get(model, "descriptor", "model"), state)
    fitting = invariant_fitting_from_deepmd(r, r.get(model, "fitting", "model"), ntypes, state)
    width = int(fitting["numb_dos"] if fitting["type"] == "dos" else fitting["task_dim"])
    variables = model.get("@variables") or {}
    for key, fill in (("out_bias", 0.0), ("out_std", 1.0)):
        value = variables.get(key)
        arr = np.full((1, ntypes, width), fill) if value is None else np.asarray(value, float)
        if arr.size != ntypes * width:
            raise MDTrainError(f"{source}: model/@variables/{key}: shape {arr.shape}")
        state[key] = torch.from_numpy(arr.reshape(ntypes, width).copy())
    excluded = set(model.get("atom_exclude_types") or [])
    excluded |= set((model.get("fitting") or {}).get("exclude_types") or [])
    config = {
        "type_map": type_map,
        "descriptor": descriptor,
        "fitting_net": fitting,
        "atom_exclude_types": sorted(int(t) for t in excluded),
    }
    try:
        config = normalize_model_config(config)
    except MDTrainError as exc:
        raise MDTrainError(f"{source}: {exc}") from None
    return config, state
