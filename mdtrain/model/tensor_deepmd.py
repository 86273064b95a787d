"""A `TensorModel` as DeePMD-kit's serialised model dict (a "standard" model whose fitting is
``dipole`` or ``polar``), and back: what ``.dp`` files of DeePMD-kit's ``DeepDipole`` /
``DeepPolar`` models hold. The model frame is `mdtrain.model.deepmd_standard`'s; the
fitting part `mdtrain.model.fittings.deepmd_io`'s; the atomic model's ``out_bias``
(1, ntypes, 3 or 9) and ``out_std`` are our buffers of the same names.
"""

from __future__ import annotations

import torch

from mdtrain.model.deepmd_nets import activation_out
from mdtrain.model.deepmd_standard import (
    standard_def_script,
    standard_model_dict,
    standard_model_from_deepmd,
)
from mdtrain.model.fittings.deepmd_io import fitting_from_deepmd, fitting_to_deepmd
from mdtrain.model.tensor import TENSOR_LABELS, TensorModel


def is_tensor_deepmd(data: dict) -> bool:
    """True for a DeePMD-kit file dict whose model fits dipoles or polarizabilities."""
    fitting = (data.get("model") or {}).get("fitting") or {}
    return fitting.get("type") in TENSOR_LABELS


def tensor_model_to_deepmd(model: TensorModel) -> dict:
    """DeePMD-kit's ``model`` dict of ``model``."""
    fcfg = model.get_model_config()["fitting_net"]
    act = activation_out(fcfg["activation_function"], "model/fitting_net")
    fitting = fitting_to_deepmd(model.fitting, fcfg, list(model.type_map), act)
    return standard_model_dict(model, fitting, model.tensor_size)


def tensor_def_script(model: TensorModel) -> dict:
    """The ``model`` section of a DeePMD-kit input that builds this architecture (stored as
    ``model_def_script``): DeePMD-kit's keys only, the selected types as
    ``atom_exclude_types`` (the PyTorch backend's way)."""
    return standard_def_script(model, drop=("sel_type", "embedding_width"))


def tensor_model_from_deepmd(data: dict, source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model_config, state_dict)`` of a `TensorModel` from a DeePMD-kit file dict."""
    return standard_model_from_deepmd(
        data, source, fitting_from_deepmd, lambda fit: TENSOR_LABELS[fit["type"]][1]
    )


def load_tensor_model(data: dict, source: str) -> TensorModel:
    """A ready `TensorModel` (float64 weights as stored) of a DeePMD-kit file dict."""
    config, state = tensor_model_from_deepmd(data, source)
    model = TensorModel(config)
    model.load_state_dict(state)
    return model
