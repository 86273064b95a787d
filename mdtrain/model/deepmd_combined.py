"""DeePMD-kit's serialised form of the combined models, both ways (the ``model`` dict of a
``.dp`` file): ``"zbl"`` (DP+ZBL, ``use_srtab``), ``"linear"`` (``linear_ener``) and their
``"pairtab"`` parts, each with DeePMD-kit 3.2's keys (``deepmd/dpmodel/atomic_model/``).
A network part is the ``"standard"`` dict of ``deepmd_format``; the combined model's energy
bias is its ``out_bias``. A part's table travels as DeePMD-kit's ``PairTab`` (the table as
extended to the cut-off, its ``tab_info`` and spline ``tab_data``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.combined import CombinedModel, ZBLModel
from mdtrain.model.combined_build import TABLE_ROWS
from mdtrain.model.deepmd_format import deepmd_to_model, model_to_deepmd
from mdtrain.model.pair_energy import PairTableEnergy

COMBINED_TYPES = ("zbl", "linear", "linear_ener", "pairtab")


def _atomic_base(type_map: list[str], out_bias: np.ndarray) -> dict:
    ntypes = len(type_map)
    return {
        "type_map": list(type_map),
        "atom_exclude_types": [],
        "pair_exclude_types": [],
        "rcond": None,
        "preset_out_bias": None,
        "@variables": {
            "out_bias": np.asarray(out_bias, dtype=np.float64).reshape(1, ntypes, 1),
            "out_std": np.ones((1, ntypes, 1)),
        },
    }


def _pairtab_out(part: PairTableEnergy) -> dict:
    tab = {
        "@class": "PairTab",
        "@version": 1,
        "rmin": part.rmin,
        "rmax": part.rmax,
        "hh": part.hh,
        "ntypes": part.ntypes,
        "rcut": part.rcut,
        "nspline": part.nspline,
        "@variables": {
            "vdata": part.tab_vdata.detach().cpu().numpy(),
            "tab_info": part.tab_info.detach().cpu().numpy(),
            "tab_data": part.tab_data.detach().cpu().numpy().reshape(-1),
        },
    }
    base = _atomic_base(part.type_map, np.zeros(part.ntypes))
    extra = {"@class": "Model", "type": "pairtab", "@version": 2, "tab": tab}
    return {**base, **extra, "rcut": part.rcut, "sel": part.nsel}


def _part_out(part: torch.nn.Module) -> dict:
    if isinstance(part, PairTableEnergy):
        return _pairtab_out(part)
    return model_to_deepmd(part)


def combined_to_deepmd(model: CombinedModel) -> dict:
    """DeePMD-kit's ``model`` dict of a combined model."""
    bias = model.out_bias.detach().cpu().numpy()
    base = _atomic_base(model.type_map, bias)
    models = [_part_out(p) for p in model.parts]
    if isinstance(model, ZBLModel):
        extra = {"sw_rmin": model.sw_rmin, "sw_rmax": model.sw_rmax, "smin_alpha": model.smin_alpha}
        return {**base, "@class": "Model", "@version": 2, "type": "zbl", "models": models,
                "weights": "mean", **extra}  # fmt: skip
    if len(model.parts) == 1:
        raise MDTrainError(
            "a pairtab model alone cannot be written as a .dp file (DeePMD-kit reads it only "
            "as a part of a linear_ener model)"
        )
    weights = model.get_model_config().get("weights")
    # "linear_ener", not the "linear" DeePMD-kit 3.2 writes: its PyTorch reader (dp
    # convert-backend) knows only the former, its numpy reader both
    return {**base, "@class": "Model", "@version": 3, "type": "linear_ener", "models": models,
            "weights": weights}  # fmt: skip


def combined_def_script(model: CombinedModel) -> dict:
    """The model section, without the table rows (DeePMD-kit's ``model_def_script``)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != TABLE_ROWS}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(model.get_model_config())


# -- reading ---------------------------------------------------------------------------------


def _pairtab_in(d: dict, source: str, where: str) -> dict:
    tab = d.get("tab")
    rows = (tab or {}).get("@variables", {}).get("vdata") if isinstance(tab, dict) else None
    if rows is None:
        raise MDTrainError(f"{source}: {where}/tab/@variables/vdata: missing")
    bias = np.asarray(d.get("@variables", {}).get("out_bias", 0.0))
    if np.any(bias != 0):
        raise MDTrainError(
            f"{source}: {where}/@variables/out_bias: a pairtab part's own bias is not supported"
        )
    return {"type": "pairtab", "tab_file": f"{source} ({where})", TABLE_ROWS: np.asarray(rows).tolist(),
            "rcut": float(d["rcut"]), "sel": int(np.sum(d["sel"]))}  # fmt: skip


def _standard_in(d: dict, source: str, prefix: str, state: dict) -> dict:
    config, sub_state = deepmd_to_model({"model": d}, source)
    state.update({f"{prefix}.{k}": v for k, v in sub_state.items()})
    return config


def deepmd_to_combined(data: dict, source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model_config, state_dict)`` of the combined model in a DeePMD file dict."""
    model = data["model"]
    kind = model.get("type")
    type_map = [str(t) for t in model.get("type_map", [])]
    subs = model.get("models")
    if kind not in ("zbl", "linear", "linear_ener") or not isinstance(subs, list):
        raise MDTrainError(f"{source}: model: a {kind!r} model is not supported here")
    for key in ("atom_exclude_types", "pair_exclude_types"):
        if model.get(key):
            raise MDTrainError(f"{source}: model/{key}: not supported with combined models")
    state: dict[str, torch.Tensor] = {}
    configs = []
    for k, sub in enumerate(subs):
        where = f"model/models/{k}"
        if sub.get("type") == "pairtab":
            configs.append(_pairtab_in(sub, source, where))
        elif sub.get("type", "standard") == "standard":
            configs.append(_standard_in(sub, source, f"parts.{k}", state))
        else:
            raise MDTrainError(f"{source}: {where}: a {sub.get('type')!r} part is not supported")
    variables = model.get("@variables") or {}
    ntypes = len(type_map)
    bias = np.asarray(variables.get("out_bias", np.zeros((1, ntypes, 1))), dtype=np.float64)
    state["out_bias"] = torch.from_numpy(bias.reshape(ntypes).copy())
    std = np.asarray(variables.get("out_std", np.ones((1, ntypes, 1))), dtype=np.float64)
    state["out_std"] = torch.from_numpy(std.reshape(ntypes).copy())
    if kind == "zbl":
        if (
            len(configs) != 2
            or "descriptor" not in configs[0]
            or configs[1].get("type") != "pairtab"
        ):
            raise MDTrainError(f"{source}: model/models: a zbl model is a network and a pairtab")
        dp, table = configs
        config = {**dp, "use_srtab": table["tab_file"], TABLE_ROWS: table[TABLE_ROWS],
                  "sw_rmin": float(model["sw_rmin"]), "sw_rmax": float(model["sw_rmax"]),
                  "smin_alpha": float(model.get("smin_alpha") or 0.1)}  # fmt: skip
        return config, state
    config = {"type": "linear_ener", "type_map": type_map, "models": configs,
              "weights": model.get("weights", "mean")}  # fmt: skip
    return config, state


def is_combined_dict(data: dict) -> bool:
    """Whether a DeePMD file dict holds a combined model."""
    return isinstance(data.get("model"), dict) and data["model"].get("type") in COMBINED_TYPES
