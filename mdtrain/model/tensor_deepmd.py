"""A `TensorModel` as DeePMD-kit's serialised model dict (a "standard" model whose fitting is
``dipole`` or ``polar``), and back: what ``.dp`` files of DeePMD-kit's ``DeepDipole`` /
``DeepPolar`` models hold. The descriptor part is `mdtrain.model.deepmd_format`'s; the
fitting part `mdtrain.model.fittings.deepmd_io`'s; the atomic model's ``out_bias``
(1, ntypes, 3 or 9) and ``out_std`` are our buffers of the same names.
"""

from __future__ import annotations

import numpy as np
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.config import normalize_model_config
from mdtrain.model.deepmd_format import descriptor_from_deepmd
from mdtrain.model.deepmd_nets import Reader, activation_out, check_fitting_follows
from mdtrain.model.fittings.deepmd_io import fitting_from_deepmd, fitting_to_deepmd
from mdtrain.model.tensor import TENSOR_LABELS, TensorModel


def is_tensor_deepmd(data: dict) -> bool:
    """True for a DeePMD-kit file dict whose model fits dipoles or polarizabilities."""
    fitting = (data.get("model") or {}).get("fitting") or {}
    return fitting.get("type") in TENSOR_LABELS


def tensor_model_to_deepmd(model: TensorModel) -> dict:
    """DeePMD-kit's ``model`` dict of ``model``."""
    cfg = model.get_model_config()
    type_map, ntypes = list(model.type_map), model.ntypes
    act = activation_out(cfg["fitting_net"]["activation_function"], "model/fitting_net")
    size = model.tensor_size
    return {
        "@class": "Model",
        "type": "standard",
        "@version": 2,
        "type_map": type_map,
        "atom_exclude_types": [int(t) for t in model.excluded],
        "pair_exclude_types": [],
        "rcond": None,
        "preset_out_bias": None,
        "descriptor": model.descriptor.to_deepmd(cfg["descriptor"], type_map),
        "fitting": fitting_to_deepmd(model.fitting, cfg["fitting_net"], type_map, act),
        "@variables": {
            "out_bias": model.out_bias.detach().cpu().numpy().reshape(1, ntypes, size).copy(),
            "out_std": model.out_std.detach().cpu().numpy().reshape(1, ntypes, size).copy(),
        },
    }


def tensor_def_script(model: TensorModel) -> dict:
    """The ``model`` section of a DeePMD-kit input that builds this architecture (stored as
    ``model_def_script``): DeePMD-kit's keys only, the selected types as
    ``atom_exclude_types`` (the PyTorch backend's way)."""
    cfg = model.get_model_config()
    fit = {k: v for k, v in cfg["fitting_net"].items() if k not in ("sel_type", "embedding_width")}
    script = {
        "type_map": cfg["type_map"],
        "descriptor": dict(cfg["descriptor"]),
        "fitting_net": fit,
        "atom_exclude_types": [int(t) for t in model.excluded],
        "data_stat_nbatch": cfg["data_stat_nbatch"],
    }
    for name in ("descriptor", "fitting_net"):
        section = script[name]
        section["activation_function"] = activation_out(
            section["activation_function"], f"model/{name}"
        )
    return script


def tensor_model_from_deepmd(data: dict, source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model_config, state_dict)`` of a `TensorModel` from a DeePMD-kit file dict."""
    r = Reader(source)
    model = r.get(data, "model", "file")
    if model.get("@class") != "Model" or model.get("type", "standard") != "standard":
        raise r.fail("model", "not a standard DeePMD-kit model")
    r.off(model, "pair_exclude_types", "model", "pair_exclude_types")
    type_map = [str(t) for t in r.get(model, "type_map", "model")]
    ntypes = len(type_map)
    state: dict[str, torch.Tensor] = {}
    descriptor = descriptor_from_deepmd(r, r.get(model, "descriptor", "model"), state)
    check_fitting_follows(r, r.get(model, "fitting", "model"), descriptor)
    fitting = fitting_from_deepmd(r, r.get(model, "fitting", "model"), ntypes, state)
    size = TENSOR_LABELS[fitting["type"]][1]
    variables = model.get("@variables") or {}
    for key, fill in (("out_bias", 0.0), ("out_std", 1.0)):
        value = variables.get(key)
        arr = np.full((1, ntypes, size), fill) if value is None else np.asarray(value, float)
        if arr.size != ntypes * size:
            raise MDTrainError(f"{source}: model/@variables/{key}: shape {arr.shape}")
        state[key] = torch.from_numpy(arr.reshape(ntypes, size).copy())
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


def load_tensor_model(data: dict, source: str) -> TensorModel:
    """A ready `TensorModel` (float64 weights as stored) of a DeePMD-kit file dict."""
    config, state = tensor_model_from_deepmd(data, source)
    model = TensorModel(config)
    model.load_state_dict(state)
    return model
