"""Load a model for inference from a checkpoint (.pt), a frozen TorchScript file (.pth), an
exported program (.pt2, ``mdtrain.infer.program``: run as the program itself) or a DeePMD-kit
model file (.dp, ``mdtrain.model.deepmd_file``).

Checkpoints, frozen files and programs are zip archives; a TorchScript archive is recognised
by its ``constants.pkl`` or ``code/`` entries, a program by its ``archive_format``, whatever
the file is called. Checkpoints are read with ``weights_only=True`` (never runs code). Every
way the result is a module in eval mode with
the EnergyModel forward and the attributes ``type_map``, ``rcut`` and ``sel``.

A frozen file is loaded by default as an eager EnergyModel built from the ``model_config``
that ``mdtrain freeze`` stores beside the TorchScript module, with the module's weights:
TorchScript runs the reference model, the eager model the fastest backend for the device
(``mdtrain.model.backend``; on the water model on a CPU, 2× the frames/s), with the same
results to rounding.
``scripted=True`` returns the TorchScript module itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator

import torch

from mdtrain.errors import MDTrainError
from mdtrain.infer.finite import check_weights
from mdtrain.infer.program import is_exported_program, load_program
from mdtrain.model.config import stored_model_config
from mdtrain.model.files import (
    has_average,
    is_torchscript,
    model_weights,
    per_type_fitting_problem,
    weights_mismatch,
)

log = logging.getLogger("mdtrain.load")

#: The newest checkpoint of a training output folder (a link to ``model.ckpt-<step>.pt``).
CHECKPOINT = "model.ckpt.pt"

#: Name of the JSON metadata stored in a frozen model's ``_extra_files``.
FROZEN_METADATA = "mdtrain.json"


@contextlib.contextmanager
def quiet_jit() -> Iterator[None]:
    """Silence torch's deprecation notices for TorchScript: frozen files are TorchScript on
    purpose (loadable from C++ and from Python without mdtrain)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        yield


def model_file(path: str | os.PathLike) -> str:
    """The model file ``path`` names: itself, or in a training output folder its newest
    checkpoint (``model.ckpt.pt``), as ``freeze -c`` and ``model-devi -m`` take it."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return path
    single = os.path.join(path, CHECKPOINT)
    if os.path.isfile(single):
        return single
    members = sorted(n for n in os.listdir(path) if n.startswith("member-"))
    if members:
        raise MDTrainError(
            f"model {path}: a committee folder; give one member, e.g. "
            f"{os.path.join(path, members[0])}"
        )
    raise MDTrainError(f"model {path}: a folder without {CHECKPOINT} (no training output)")


def model_from_checkpoint(
    state: dict, source: str = "checkpoint", device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Build the model of a checkpoint dict (``model_config`` + ``model_state``) on ``device``,
    with the fastest backend there (``mdtrain.model.backend``)."""
    from mdtrain.model.backend import build_model

    if "model_config" not in state or "model_state" not in state:
        raise MDTrainError(f"{source}: no model_config/model_state in the checkpoint")
    try:
        model = build_model(state["model_config"], device)
    except MDTrainError as exc:
        raise MDTrainError(f"{source}: incompatible model_config: {exc}") from None
    weights = state["model_state"]
    if any(k.startswith("module.") for k in weights):  # saved from a DDP wrapper
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    mismatch = weights_mismatch(model, weights)
    if mismatch:
        raise MDTrainError(f"{source}: model_state does not match model_config: {mismatch}")
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0][:200]
        raise MDTrainError(f"{source}: model_state does not match model_config ({first})") from None
    return model


def load_model(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    scripted: bool = False,
    live: bool = False,
) -> torch.nn.Module:
    """The model stored in ``path`` (checkpoint or frozen), on ``device``, in eval mode; a
    frozen one as its TorchScript module only with ``scripted`` (see the module docstring);
    an EMA run's checkpoint with its averaged weights unless ``live``
    (`mdtrain.model.files.model_weights`)."""
    from mdtrain.model.deepmd_file import is_dp_file, load_dp
    from mdtrain.model.files import load_checkpoint

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MDTrainError(f"model {path}: file not found")
    if path.endswith((".pb", ".savedmodel")):
        raise MDTrainError(
            f"model {path}: a DeePMD-kit TensorFlow model; mdtrain reads DeePMD-kit's "
            f"backend-independent file: dp convert-backend {path} model.dp"
        )
    if is_dp_file(path):
        model = model_from_checkpoint(load_dp(path), f"model {path}", device)
    elif is_exported_program(path):
        model = load_program(path, device)
    elif is_torchscript(path):
        # the eager model only borrows the frozen weights: read them on the CPU, copied once
        model, metadata = _load_frozen(path, device if scripted else "cpu")
        if not scripted and "model_config" in metadata:
            model = _eager_from_frozen(path, model, metadata["model_config"], device)
        elif not scripted:  # no model_config stored: the TorchScript module after all
            model = model.to(device)
    else:
        state = load_checkpoint(path, map_location="cpu")
        note = weights_note(path, state, live)
        if note:
            log.info("%s", note)
        model = model_from_checkpoint(
            model_weights(state, live, f"model {path}"), f"model {path}", device
        )
    check_weights(model, f"model {path}")
    return model.eval()


def _jit_load(path: str, device: str | torch.device) -> tuple[torch.nn.Module, dict]:
    """The TorchScript module and the metadata ``mdtrain freeze`` stored with it ({} if none)."""
    extra = {FROZEN_METADATA: ""}
    try:
        with quiet_jit():
            model = torch.jit.load(path, map_location=device, _extra_files=extra)
    except Exception as exc:  # corrupt archives raise RuntimeError, sometimes others
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise MDTrainError(f"model {path}: cannot load the frozen model ({first})") from None
    raw = extra[FROZEN_METADATA]
    if not raw:
        return model, {}
    try:
        metadata = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, UnicodeDecodeError):
        raise MDTrainError(f"model {path}: unreadable {FROZEN_METADATA} metadata") from None
    if isinstance(metadata, dict) and "model_config" in metadata:
        # names whose meaning changed keep the function the model was trained with
        metadata["model_config"] = stored_model_config(metadata["model_config"])
    return model, metadata


def _load_frozen(path: str, device: str | torch.device) -> tuple[torch.nn.Module, dict]:
    """``_jit_load``, for an mdtrain model (one with ``type_map``, ``rcut`` and ``sel``)."""
    model, metadata = _jit_load(path, device)
    for name in ("type_map", "rcut", "sel"):
        if not hasattr(model, name):
            raise MDTrainError(
                f"model {path}: a TorchScript file without {name!r}; not an mdtrain model"
            )
    return model, metadata


def _eager_from_frozen(
    path: str, module: torch.nn.Module, config: dict, device: str | torch.device
) -> torch.nn.Module:
    """The model of ``config`` on ``device`` with the TorchScript module's weights (see the
    module docstring)."""
    from mdtrain.model.backend import build_model

    try:
        model = build_model(config, device)
    except MDTrainError as exc:
        raise MDTrainError(f"model {path}: incompatible model_config: {exc}") from None
    weights = module.state_dict()
    old = per_type_fitting_problem(config, weights)
    if old:  # strict=False below would drop the other types' nets silently
        raise MDTrainError(f"model {path}: {old}")
    # TorchScript also keeps the non-persistent buffers (type-pair masks): not needed here
    try:
        missing = model.load_state_dict(weights, strict=False).missing_keys
    except RuntimeError as exc:  # a shape that does not match the config
        first = str(exc).strip().splitlines()[-1].strip()[:200]
        raise MDTrainError(
            f"model {path}: frozen weights do not match model_config ({first})"
        ) from None
    if missing:
        raise MDTrainError(f"model {path}: the frozen weights lack {missing[0]!r}")
    return model


def weights_note(path: str, state: dict, live: bool) -> str | None:
    """The log line saying which weights of an EMA run's checkpoint a command uses."""
    if not has_average(state):
        return None
    if live:
        return f"{path}: the live weights of a run with a weight average (--live-weights)"
    return f"{path}: the averaged weights (training.enable_ema; --live-weights for the live ones)"


def read_frozen_metadata(path: str | os.PathLike) -> dict:
    """The JSON metadata written by ``mdtrain freeze`` (model_config, version, ...)."""
    path = os.fspath(path)
    metadata = _jit_load(path, "cpu")[1]
    if not metadata:
        raise MDTrainError(f"model {path}: no {FROZEN_METADATA} metadata (not frozen by mdtrain)")
    return metadata
