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

#: The weight average of a run with ``training.enable_ema``, in each of its regular
#: checkpoints beside the live weights: ``{"decay": float, "model": {parameter: tensor}}``.
EMA_KEY = "ema"
#: True in a checkpoint whose ``model_state`` holds averaged weights (no optimiser state).
AVERAGED = "averaged_weights"
#: "live" in a checkpoint that carries an average but stands for its live weights (the best
#: checkpoints that full validation ranked by the live weights).
STANDS_FOR = "stands_for"


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


def has_average(state: dict) -> bool:
    """Whether the checkpoint ``state`` stands for its weight average (see `model_weights`)."""
    return bool((state.get(EMA_KEY) or {}).get("model")) and state.get(STANDS_FOR) != "live"


def model_weights(state: dict, live: bool = False, source: str = "checkpoint") -> dict:
    """The checkpoint as a model to use: a regular checkpoint of a run with
    ``training.enable_ema`` keeps the live weights and their average, so that ``--restart``
    continues both exactly, and stands for the average, the model the run was asked to
    make. Its parameters are then replaced by the averaged ones (buffers, such as the
    statistics and the energy bias, are the model's own) and it is marked `AVERAGED`;
    ``live`` keeps the live weights. Any other checkpoint is returned as it is."""
    if live or not has_average(state):
        return state
    weights = dict(state["model_state"])
    prefix = "module." if any(k.startswith("module.") for k in weights) else ""
    for name, tensor in state[EMA_KEY]["model"].items():
        own = weights.get(prefix + name)
        if not torch.is_tensor(own) or tuple(own.shape) != tuple(tensor.shape):
            raise MDTrainError(f"{source}: its weight average ({EMA_KEY}) does not fit its weights")
        weights[prefix + name] = tensor.to(own.dtype)
    averaged = {k: v for k, v in state.items() if k not in (EMA_KEY, "optimizer_state")}
    averaged["model_state"] = weights
    averaged[AVERAGED] = True
    return averaged


def load_model_file(path: str | os.PathLike, live: bool = False) -> dict:
    """A checkpoint dict (at least ``model_config`` and ``model_state``) from an mdtrain
    checkpoint or a DeePMD-kit ``.dp`` model file: what ``--init-model``, ``--finetune`` and
    ``freeze`` accept; an EMA run's checkpoint with its averaged weights unless ``live``
    (`model_weights`)."""
    from mdtrain.model.deepmd_file import is_dp_file, load_dp

    if is_dp_file(path):
        return load_dp(path)
    return model_weights(load_checkpoint(path), live, f"checkpoint {os.fspath(path)}")
