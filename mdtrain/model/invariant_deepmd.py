"""An `InvariantModel` (DOS, property) as DeePMD-kit's serialised model dict (a "standard"
model whose fitting is ``dos`` or ``property``), and back: what ``.dp`` files of DeePMD-kit's
``DeepDOS`` / ``DeepProperty`` models hold. The model frame is
`mdtrain.model.deepmd_standard`'s, the fitting part `mdtrain.model.fittings.invariant_io`'s;
the atomic model's ``out_bias``/``out_std`` (1, ntypes, k) are our buffers of those names.
"""

from __future__ import annotations

import torch

from mdtrain.model.deepmd_nets import activation_out
from mdtrain.model.deepmd_standard import (
    standard_def_script,
    standard_model_dict,
    standard_model_from_deepmd,
)
from mdtrain.model.fittings.invariant_config import INVARIANT_TYPES, output_width
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
    fcfg = model.get_model_config()["fitting_net"]
    act = activation_out(fcfg["activation_function"], "model/fitting_net")
    fitting = invariant_fitting_to_deepmd(model.fitting, fcfg, list(model.type_map), act)
    return standard_model_dict(model, fitting, model.width)


def invariant_def_script(model: InvariantModel) -> dict:
    """The ``model`` section of a DeePMD-kit input that builds this architecture."""
    return standard_def_script(model)


def invariant_model_from_deepmd(data: dict, source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model_config, state_dict)`` of an `InvariantModel` from a DeePMD-kit file dict."""
    return standard_model_from_deepmd(data, source, invariant_fitting_from_deepmd, output_width)
