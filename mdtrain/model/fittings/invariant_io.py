"""DOS and property fittings as DeePMD-kit 3.2's serialised fitting dict, and back.

The dict is the one ``deepmd.dpmodel.fitting`` (``DOSFittingNet``, ``PropertyFittingNet``,
both ``InvarFitting``) ``serialize`` writes: per-type ``FittingNetwork``s of ``dim_out``
outputs (``numb_dos`` / ``task_dim``) in a ``NetworkCollection``, ``bias_atom_e`` (ntypes,
dim_out); a property fitting adds ``property_name`` (as ``var_name``), ``task_dim``,
``intensive`` and ``distinguish_types``. What mdtrain cannot run (frame or atomic parameters,
case embeddings, shared layers) is refused by name.
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
    network_layers,
    precision_in,
    to_numpy,
)
from mdtrain.model.fittings.deepmd_io import UNSUPPORTED

_VERSIONS = {"dos": 4, "property": 6}


def invariant_fitting_to_deepmd(
    nets: torch.nn.Module, fcfg: dict, type_map: list[str], act: str, exclude: list[int]
) -> dict:
    """DeePMD-kit's dict of the `TypeFittingNets` ``nets`` of section ``fcfg``."""
    ntypes, kind = nets.ntypes, fcfg["type"]
    networks = []
    for net in nets.networks:
        data = fitting_net_dict(net, nets.dim_in, {**fcfg, "trainable": True}, act)
        data["out_dim"] = nets.n_out
        networks.append(data)
    data: dict[str, Any] = {
        "@class": "Fitting",
        "@version": _VERSIONS[kind],
        "type": kind,
        "var_name": "dos" if kind == "dos" else fcfg["property_name"],
        "ntypes": ntypes,
        "dim_descrpt": nets.dim_in,
        "dim_out": nets.n_out,
        "neuron": [int(n) for n in fcfg["neuron"]],
        "resnet_dt": bool(fcfg["resnet_dt"]),
        "numb_fparam": 0,
        "numb_aparam": 0,
        "dim_case_embd": 0,
        "default_fparam": None,
        "rcond": fcfg.get("rcond"),
        "activation_function": act,
        "precision": PRECISION_NAMES[nets.dtype],
        "mixed_types": False,
        "exclude_types": list(exclude),
        "nets": collection_dict(networks, 1, ntypes, "fitting_network"),
        "@variables": {
            "bias_atom_e": to_numpy(nets.bias_atom_e),
            "case_embd": None,
            "fparam_avg": None,
            "fparam_inv_std": None,
            "aparam_avg": None,
            "aparam_inv_std": None,
        },
        "type_map": list(type_map),
        "tot_ener_zero": False,
        "trainable": [bool(fcfg["trainable"])] * (len(fcfg["neuron"]) + 1),
        "layer_name": None,
        "use_aparam_as_mask": False,
        "spin": None,
        "atom_ener": None,
    }
    if kind == "property":
        data["task_dim"] = nets.n_out
        data["intensive"] = bool(fcfg["intensive"])
        data["distinguish_types"] = bool(fcfg["distinguish_types"])
    return data


def invariant_fitting_from_deepmd(
    r: Reader, f: dict, ntypes: int, state: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The ``model.fitting_net`` section of DeePMD-kit's DOS/property fitting dict ``f``; its
    parameters and buffers go into ``state`` under ``fitting.*``."""
    where = "model/fitting"
    kind = f.get("type")
    if kind not in _VERSIONS:
        raise r.fail(f"{where}/type", f"{kind!r} is not a dos or property fitting")
    for key, (what, allowed) in UNSUPPORTED.items():
        r.off(f, key, where, what, allowed=allowed)
    networks = r.get(r.get(f, "nets", where), "networks", f"{where}/nets")
    if len(networks) != ntypes:
        raise r.fail(f"{where}/nets", f"{len(networks)} networks, expected {ntypes}")
    for t, net in enumerate(networks):
        network_layers(r, net, f"{where}/nets/networks/{t}", f"fitting.networks.{t}", state)
    variables = r.get(f, "@variables", where)
    bias = r.array(variables, "bias_atom_e", where).astype(np.float64)
    width = int(r.get(f, "dim_out", where))
    state["fitting.bias_atom_e"] = torch.from_numpy(bias.reshape(ntypes, width).copy())
    act = activation_in(r, f.get("activation_function", "tanh"), where)
    section: dict[str, Any] = {
        "type": kind,
        "neuron": [int(n) for n in r.get(f, "neuron", where)],
        "activation_function": "linear" if act == "none" else act,
        "resnet_dt": bool(f.get("resnet_dt", True)),
        "precision": precision_in(r, f.get("precision", "float64"), where),
        "seed": None,
    }
    if kind == "dos":
        section.update(numb_dos=width, rcond=f.get("rcond"))
    else:
        section.update(
            property_name=str(r.get(f, "var_name", where)),
            task_dim=width,
            intensive=bool(f.get("intensive", False)),
            # DeePMD-kit reads a file without it as False (older files)
            distinguish_types=bool(f.get("distinguish_types", False)),
        )
    return section
