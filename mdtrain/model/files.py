"""Reading model files: a checkpoint written by training, loaded safely.

Inference, freezing and training all read checkpoints; only training writes them (atomic
writes, rotation and RNG state stay in ``mdtrain.train.checkpoint``, which documents the
dict a checkpoint holds). Loading uses ``torch.load(weights_only=True)``, so it never runs
code, and every problem becomes a one-line `MDTrainError` naming the file.
"""

from __future__ import annotations

import errno
import os
import pickle

import torch

from mdtrain.config.mixed_types import shares_fitting_net
from mdtrain.errors import MDTrainError
from mdtrain.model.config import stored_model_config
from mdtrain.outputs import KIND_FROZEN, file_kind

#: ``format`` and ``version`` entries of a checkpoint dict (written by ``save_checkpoint``).
FORMAT = "mdtrain-checkpoint"
VERSION = 1


def checkpoint_io_error(path: str, exc: OSError, action: str = "write") -> MDTrainError:
    """The one-line error for an I/O failure on checkpoint ``path`` (reading or writing)."""
    if exc.errno == errno.ENOSPC:
        reason = "no space left on device"
    elif exc.errno == errno.EDQUOT:
        reason = "disk quota exceeded"
    else:
        reason = exc.strerror or str(exc)
    return MDTrainError(f"cannot {action} checkpoint {path}: {reason}")


def _first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()[:200]
    return type(exc).__name__


def is_torchscript(path: str | os.PathLike) -> bool:
    """True when ``path`` is a TorchScript archive (``torch.jit.save``), not a pickle."""
    return file_kind(path) == KIND_FROZEN


def weights_mismatch(model: torch.nn.Module, weights: dict) -> str | None:
    """The first array of ``weights`` whose shape differs from ``model``'s, named with
    both shapes (None when every shared name fits): what ``load_state_dict`` says only
    after a paragraph."""
    for key, expected in model.state_dict().items():
        given = weights.get(key)
        if torch.is_tensor(given) and tuple(given.shape) != tuple(expected.shape):
            return (
                f"array {key} has shape {tuple(given.shape)}, the model of its config needs "
                f"{tuple(expected.shape)}"
            )
    return None


def per_type_fitting_problem(model_config: object, weights: dict) -> str | None:
    """The problem of weights with one fitting net per type for a type-mixed descriptor (the
    layout mdtrain wrote before its fitting followed DeePMD-kit: one net for all types), or
    None. Such weights are refused, not mapped: the shared net is another function."""
    if not isinstance(model_config, dict):
        return None
    parts = [(p, model_config.get("descriptor")) for p in ("", "parts.0.")]
    models = model_config.get("models")
    if isinstance(models, list):
        parts += [(f"parts.{k}.", m.get("descriptor")) for k, m in enumerate(models) if m]
    for prefix, descriptor in parts:
        if not shares_fitting_net(descriptor):
            continue
        heads = (f"{prefix}fitting.networks.1.", f"{prefix}fitting.nets.networks.1.")
        if any(k.removeprefix("module.").startswith(heads) for k in weights):
            return (
                f"its {descriptor.get('type')} model has one fitting net per type, mdtrain's "
                "layout before its fitting followed DeePMD-kit's (one net for all types after "
                "a type-mixed descriptor); retrain it"
            )
    return None


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint with ``weights_only=True``; any problem is one-line `MDTrainError`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MDTrainError(f"checkpoint {path}: file not found")
    if is_torchscript(path):
        raise MDTrainError(
            f"checkpoint {path}: this is a frozen model (TorchScript, from mdtrain freeze); give "
            "the checkpoint it was frozen from (model.ckpt-<step>.pt of its training folder)"
        )
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; open errors are I/O errors)
    except OSError as exc:
        raise checkpoint_io_error(path, exc, action="read") from exc
    try:
        with f:
            state = torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln]
        if detail:
            raise MDTrainError(
                f"checkpoint {path}: refused to load, it holds Python objects other than "
                f"tensors and plain containers ({detail[0][:200]})"
            ) from None
        lines = [ln.strip() for ln in str(exc).split("WeightsUnpickler error:")[-1].splitlines()]
        reason = next((ln for ln in lines if ln), _first_line(exc))[:200]
        raise MDTrainError(f"checkpoint {path}: not a valid checkpoint file ({reason})") from None
    except Exception as exc:  # zip/pickle/EOF errors (even OSError EINVAL) of a damaged file
        raise MDTrainError(
            f"checkpoint {path}: corrupt or truncated file ({_first_line(exc)})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise MDTrainError(f"checkpoint {path}: not an mdtrain checkpoint")
    if state.get("version") != VERSION:
        raise MDTrainError(
            f"checkpoint {path}: incompatible checkpoint version {state.get('version')!r} "
            f"(this mdtrain reads version {VERSION})"
        )
    if "model_config" in state:  # names whose meaning changed keep the function trained with
        state["model_config"] = stored_model_config(state["model_config"])
        old = per_type_fitting_problem(state["model_config"], state.get("model_state") or {})
        if old:
            raise MDTrainError(f"checkpoint {path}: {old}")
    return state


def load_model_file(path: str | os.PathLike) -> dict:
    """A checkpoint dict (at least ``model_config`` and ``model_state``) from an mdtrain
    checkpoint or a DeePMD-kit ``.dp`` model file: what ``--init-model``, ``--finetune`` and
    ``freeze`` accept."""
    from mdtrain.model.deepmd_file import is_dp_file, load_dp

    return load_dp(path) if is_dp_file(path) else load_checkpoint(path)
