"""Dipole and polar fittings as DeePMD-kit 3.2's serialised fitting dict, and back.

The dict is the one ``deepmd.dpmodel.fitting`` (``DipoleFitting``/``PolarFitting``)
``serialize`` writes: per-type ``FittingNetwork``s (layers as `mdtrain.model.deepmd_nets`
writes and reads them) of ``embedding_width`` outputs (polar without ``fit_diag``: its
square), ``bias_atom_e`` (ntypes, net outputs), and for polar ``scale`` (ntypes, 1) and
``constant_matrix`` (ntypes,). ``mixed_types`` (one net for all types, ``nets`` of ``ndim``
0) follows the descriptor, as in DeePMD-kit. What mdtrain cannot run (frame or atomic
parameters, shared layers) is refused by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mdtrain.model.deepmd_nets import (
    PRECISION_NAMES,
    Reader,
    activation_in,
    collection_dict,
    fitting_net_dict,
    fitting_networks,
    network_layers,
    param_stats_in,
    param_stats_out,
    precision_in,
    to_numpy,
)

# key -> (what it is, the values meaning "off")
UNSUPPORTED = {
    "numb_fparam": ("frame parameters (fparam)", (0, None)),
    "numb_aparam": ("atomic parameters (aparam)", (0, None)),
    "dim_case_embd": ("a case embedding (multi-task)", (0, None)),
    "layer_name": ("shared fitting layers", (None,)),
    "spin": ("a spin model", (None,)),
    "use_aparam_as_mask": ("use_aparam_as_mask", (False, None)),
    "tot_ener_zero": ("tot_ener_zero", (False, None)),
}


def general_fitting_dict(
    nets: torch.nn.Module, fcfg: dict, type_map: list[str], act: str, var_name: str, version: int
) -> dict:
    """The keys every DeePMD-kit fitting dict (its ``GeneralFitting.serialize``) has, for the
    `TypeFittingNets` ``nets`` of section ``fcfg`` (``act``: the activation under DeePMD-kit's
    name), with its frame and atomic parameters' counts and statistics; one net per type, or
    one for all (``mixed_types``)."""
    ntypes = nets.ntypes
    networks = []
    for net in nets.networks:
        data = fitting_net_dict(net, nets.dim_in, {**fcfg, "trainable": True}, act)
        data["out_dim"] = nets.n_out
        networks.append(data)
    return {
        "@class": "Fitting",
        "@version": version,
        "type": fcfg["type"],
        "var_name": var_name,
        "ntypes": ntypes,
        "dim_descrpt": nets.dim_descrpt,
        "neuron": [int(n) for n in fcfg["neuron"]],
        "resnet_dt": bool(fcfg["resnet_dt"]),
        "numb_fparam": nets.numb_fparam,
        "numb_aparam": nets.numb_aparam,
        "dim_case_embd": 0,
        "default_fparam": fcfg.get("default_fparam"),
        "rcond": fcfg.get("rcond"),
        "activation_function": act,
        "precision": PRECISION_NAMES[nets.dtype],
        "mixed_types": bool(nets.mixed_types),
        "exclude_types": [t for t in range(ntypes) if float(nets.type_keep[t]) == 0.0],
        "nets": collection_dict(networks, 0 if nets.mixed_types else 1, ntypes, "fitting_network"),
        "@variables": {
            "bias_atom_e": to_numpy(nets.bias_atom_e),
            "case_embd": None,
            **param_stats_out(nets),
        },
        "type_map": list(type_map),
        "tot_ener_zero": False,
        "trainable": [bool(fcfg.get("trainable", True))] * (len(fcfg["neuron"]) + 1),
        "layer_name": None,
        "use_aparam_as_mask": False,
        "spin": None,
    }


def read_general_fitting(
    r: Reader,
    f: dict,
    ntypes: int,
    prefix: str,
    state: dict[str, torch.Tensor],
    params: bool = False,
) -> dict[str, Any]:
    """The common part of a ``fitting_net`` section from DeePMD-kit's fitting dict ``f``
    (what mdtrain cannot run refused by name); the nets' parameters go into ``state`` under
    ``<prefix>.networks.*``, ``bias_atom_e`` (ntypes, outputs) under ``<prefix>.bias_atom_e``.
    With ``params`` (the DOS and property fittings) frame and atomic parameters are read:
    their counts and ``default_fparam`` into the section, their statistics into ``state``."""
    where = "model/fitting"
    counts = {k: int(f.get(f"numb_{k}") or 0) for k in ("fparam", "aparam")}
    for key, (what, allowed) in UNSUPPORTED.items():
        if not (params and key in ("numb_fparam", "numb_aparam")):
            r.off(f, key, where, what, allowed=allowed)
    networks = fitting_networks(r, f, ntypes, where)
    for t, net in enumerate(networks):
        network_layers(r, net, f"{where}/nets/networks/{t}", f"{prefix}.networks.{t}", state)
    variables = r.get(f, "@variables", where)
    bias = r.array(variables, "bias_atom_e", where).astype(np.float64)
    state[f"{prefix}.bias_atom_e"] = torch.from_numpy(bias.reshape(ntypes, -1).copy())
    act = activation_in(r, f.get("activation_function", "tanh"), where)
    section = {
        "type": f.get("type"),
        "neuron": [int(n) for n in r.get(f, "neuron", where)],
        "activation_function": "linear" if act == "none" else act,
        "resnet_dt": bool(f.get("resnet_dt", True)),
        "precision": precision_in(r, f.get("precision", "float64"), where),
        "seed": None,
    }
    if params:
        param_stats_in(r, f, counts, state, prefix)
        section.update(
            numb_fparam=counts["fparam"],
            numb_aparam=counts["aparam"],
            default_fparam=f.get("default_fparam"),
        )
    return section


def fitting_to_deepmd(fitting: torch.nn.Module, fcfg: dict, type_map: list[str], act: str) -> dict:
    """DeePMD-kit's dict of a `DipoleFitting` or `PolarFitting` built from section ``fcfg``
    (``act``: the activation under DeePMD-kit's name)."""
    nets = fitting.nets
    polar = fcfg["type"] == "polar"
    var_name, version = ("polar", 5) if polar else ("dipole", 4)
    data = general_fitting_dict(nets, {**fcfg, "rcond": None}, type_map, act, var_name, version)
    data["embedding_width"] = fitting.embedding_width
    data["trainable"] = [True] * (len(fcfg["neuron"]) + 1)
    if polar:
        data["fit_diag"] = bool(fitting.fit_diag)
        data["shift_diag"] = bool(fitting.shift_diag)
        variables = data["@variables"]
        variables["scale"] = to_numpy(fitting.scale).reshape(nets.ntypes, 1)
        variables["constant_matrix"] = to_numpy(fitting.constant_matrix)
    else:
        data["r_differentiable"] = True
        data["c_differentiable"] = True
    return data


def fitting_from_deepmd(
    r: Reader, f: dict, ntypes: int, state: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The ``model.fitting_net`` section of DeePMD-kit's dipole/polar fitting dict ``f``; its
    parameters and buffers go into ``state`` under ``fitting.*``."""
    where = "model/fitting"
    kind = f.get("type")
    if kind not in ("dipole", "polar"):
        raise r.fail(f"{where}/type", f"{kind!r} is not a dipole or polar fitting")
    section = read_general_fitting(r, f, ntypes, "fitting.nets", state)
    if kind == "polar":
        variables = r.get(f, "@variables", where)
        scale = r.array(variables, "scale", where).astype(np.float64).reshape(-1)
        const = r.array(variables, "constant_matrix", where).astype(np.float64).reshape(-1)
        if scale.size != ntypes or const.size != ntypes:
            raise r.fail(f"{where}/@variables", f"scale/constant_matrix not of {ntypes} types")
        state["fitting.scale"] = torch.from_numpy(scale.copy())
        state["fitting.constant_matrix"] = torch.from_numpy(const.copy())
        section.update(
            fit_diag=bool(f.get("fit_diag", True)),
            shift_diag=bool(f.get("shift_diag", True)),
            scale=[float(s) for s in scale],
        )
    return section
