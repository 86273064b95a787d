"""DeePMD-kit's "standard" model dict (descriptor + fitting + the atomic model's
``out_bias``/``out_std``) of the models without forces (dipole, polar, DOS, property), both
ways: the frame every such ``.dp`` file shares. The descriptor part is each descriptor's own
(`mdtrain.model.deepmd_format`); the fitting part is the caller's (``fittings/deepmd_io.py``,
``fittings/invariant_io.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.config import normalize_model_config
from mdtrain.model.deepmd_format import descriptor_from_deepmd
from mdtrain.model.deepmd_nets import (
    Reader,
    check_fitting_follows,
    script_activations_out,
)


def standard_model_dict(model: torch.nn.Module, fitting: dict, size: int) -> dict:
    """DeePMD-kit's ``model`` dict of ``model`` (attributes ``type_map``, ``ntypes``,
    ``excluded``, ``descriptor``, buffers ``out_bias``/``out_std`` (ntypes, size)) with its
    ``fitting`` dict."""
    cfg = model.get_model_config()
    type_map, ntypes = list(model.type_map), model.ntypes

    def stat(buffer: torch.Tensor) -> np.ndarray:
        return buffer.detach().cpu().numpy().reshape(1, ntypes, size).copy()

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
        "fitting": fitting,
        "@variables": {"out_bias": stat(model.out_bias), "out_std": stat(model.out_std)},
    }


def standard_def_script(model: torch.nn.Module, drop: tuple[str, ...] = ()) -> dict:
    """The ``model`` section of a DeePMD-kit input that builds this architecture (stored as
    ``model_def_script``): the fitting's keys but ``drop``, the excluded types as
    ``atom_exclude_types`` (the PyTorch backend's way)."""
    cfg = model.get_model_config()
    fit = {k: v for k, v in cfg["fitting_net"].items() if k not in drop}
    script = {
        "type_map": cfg["type_map"],
        "descriptor": dict(cfg["descriptor"]),
        "fitting_net": fit,
        "atom_exclude_types": [int(t) for t in model.excluded],
        "data_stat_nbatch": cfg["data_stat_nbatch"],
    }
    script_activations_out(script)
    return script


def standard_model_from_deepmd(
    data: dict,
    source: str,
    read_fitting: Callable[[Reader, dict, int, dict], dict],
    size_of: Callable[[dict], int],
) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model_config, state_dict)`` from a DeePMD-kit file dict: ``read_fitting(reader,
    fitting dict, ntypes, state)`` gives the ``fitting_net`` section, ``size_of(section)``
    the values per atom of ``out_bias``/``out_std``."""
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
    fitting = read_fitting(r, r.get(model, "fitting", "model"), ntypes, state)
    size = size_of(fitting)
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
