"""DOS and property fittings as DeePMD-kit 3.2's serialised fitting dict, and back.

The dict is the one ``deepmd.dpmodel.fitting`` (``DOSFittingNet``, ``PropertyFittingNet``,
both ``InvarFitting``) ``serialize`` writes: the common fitting keys
(`mdtrain.model.fittings.deepmd_io.general_fitting_dict`: per-type ``FittingNetwork``s of
``dim_out`` outputs, ``numb_dos`` / ``task_dim``, ``bias_atom_e`` (ntypes, dim_out)), and
for a property ``property_name`` (as ``var_name``), ``task_dim``, ``intensive`` and
``distinguish_types``; frame and atomic parameters (``numb_fparam``, ``numb_aparam``,
``default_fparam`` and their statistics) both ways. What mdtrain cannot run is refused by
name.
"""

from __future__ import annotations

from typing import Any

import torch

from mdtrain.model.deepmd_nets import Reader
from mdtrain.model.fittings.deepmd_io import general_fitting_dict, read_general_fitting

_VERSIONS = {"dos": 4, "property": 6}


def invariant_fitting_to_deepmd(
    nets: torch.nn.Module, fcfg: dict, type_map: list[str], act: str
) -> dict:
    """DeePMD-kit's dict of the `TypeFittingNets` ``nets`` of section ``fcfg``."""
    kind = fcfg["type"]
    name = "dos" if kind == "dos" else fcfg["property_name"]
    data = general_fitting_dict(nets, fcfg, type_map, act, name, _VERSIONS[kind])
    data.update(dim_out=nets.n_out, atom_ener=None)
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
    section = read_general_fitting(r, f, ntypes, "fitting", state, params=True)
    width = int(r.get(f, "dim_out", where))
    if state["fitting.bias_atom_e"].shape != (ntypes, width):
        raise r.fail(f"{where}/@variables/bias_atom_e", f"not of shape ({ntypes}, {width})")
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
