"""Results that cannot be right are errors, not numbers: a model whose weights hold NaN or
infinity, or whose energy, forces or virial come out non-finite, is named (the file or the
calculator's model) with the first bad tensor or frame; committee members with identical
weights (the same model given twice, whose deviations are zero) are told apart for a
warning. Used by ``mdtrain test``, ``mdtrain model-devi`` and the ASE calculators."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch

from mdtrain.errors import MDTrainError

PREDICTIONS = ("energy", "force", "virial")


def check_weights(model: torch.nn.Module, name: str) -> None:
    """Every parameter and buffer of ``model`` is finite, else one line naming the first."""
    for key, value in model.state_dict().items():
        if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
            bad = int((~torch.isfinite(value)).sum())
            raise MDTrainError(
                f"{name}: its weights hold NaN or infinity ({bad} value(s) of {key}); it cannot "
                "give finite results: take an earlier checkpoint or retrain"
            )


def check_predictions(
    out: Mapping[str, np.ndarray], name: str, where: str, first_frame: int = 0
) -> None:
    """``out``'s energy, forces and virial (frames first) are finite, else one line naming
    the model, the quantity and the first frame (``first_frame`` is the first row's index
    in ``where``)."""
    for key in PREDICTIONS:
        if key not in out:
            continue
        values = np.asarray(out[key])
        finite = np.isfinite(values.reshape(values.shape[0], -1) if values.ndim else values)
        if not finite.all():
            rows = np.flatnonzero(~finite.all(axis=-1)) if finite.ndim > 1 else [0]
            raise MDTrainError(
                f"{name}: non-finite {key} on frame {first_frame + int(rows[0])} of {where}; "
                "the model cannot be trusted there (see docs/troubleshooting.md)"
            )


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every floating-point parameter and buffer (names and values)."""
    digest = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        if torch.is_tensor(value) and value.is_floating_point():
            digest.update(key.encode())
            digest.update(value.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def identical_pairs(models: list[torch.nn.Module], names: list[str]) -> list[tuple[str, str]]:
    """``(first, later)`` names of members whose weights are identical to an earlier one."""
    seen: dict[str, str] = {}
    pairs = []
    for model, name in zip(models, names, strict=True):
        key = weights_digest(model)
        if key in seen:
            pairs.append((seen[key], name))
        else:
            seen[key] = name
    return pairs
