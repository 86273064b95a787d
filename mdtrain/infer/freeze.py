"""Freezing: a model → a TorchScript file usable without mdtrain (for ``mdtrain freeze``).

The frozen file holds the scripted EnergyModel (same forward, attributes ``type_map``,
``rcut``, ``sel``) and, in its ``_extra_files``, ``mdtrain.json`` with the model_config, the
mdtrain version and the same attributes, so tools can read them without loading the model.
A scripted model cannot switch grad mode itself: call it with gradients enabled (forces and
virials are derivatives), e.g. under ``torch.enable_grad()``.
"""

from __future__ import annotations

import json
import os

import torch

from mdtrain import __version__
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import FROZEN_METADATA, quiet_jit
from mdtrain.model.backend import as_reference


def freeze_model(
    model: torch.nn.Module, output: str | os.PathLike, extra: dict | None = None
) -> None:
    """Script ``model`` (an EnergyModel, as its reference implementation: the accelerated
    backends are eager-only) in eval mode and save it with its metadata."""
    output = os.fspath(output)
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise MDTrainError(f"freeze: output directory {directory} does not exist")
    model = as_reference(model).eval()
    try:
        with quiet_jit():
            scripted = torch.jit.script(model)
    except Exception as exc:
        raise MDTrainError(
            f"freeze: the model cannot be scripted ({str(exc).splitlines()[0]})"
        ) from exc
    metadata = {
        "format": "mdtrain-frozen",
        "mdtrain_version": __version__,
        "torch_version": torch.__version__,
        "type_map": list(model.type_map),
        "rcut": float(model.rcut),
        "sel": [int(s) for s in model.sel],
        "model_config": model.get_model_config(),
        **(extra or {}),
    }
    files = {FROZEN_METADATA: json.dumps(metadata, sort_keys=True)}
    tmp = f"{output}.{os.getpid()}.tmp"
    try:
        with quiet_jit():
            torch.jit.save(scripted, tmp, _extra_files=files)
        os.replace(tmp, output)
    except (OSError, RuntimeError) as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise MDTrainError(f"freeze: cannot write {output} ({exc})") from None
