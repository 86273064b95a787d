"""Refitting or setting a model's per-type energy bias (``mdtrain change-bias``, DeePMD-kit's
``dp change-bias``), in a checkpoint, a DeePMD-kit ``.dp`` file or a frozen model.

Modes, as DeePMD-kit 3.2 defines them (``change_out_bias``):

- ``change``: evaluate the model on the frames, fit the per-type shift ``delta`` to the
  energy errors by least squares (``E_label - E_pred ~ N @ delta``, N the atoms of each type
  per frame) and add it to the bias;
- ``set``: the bias fitted to the label energies alone (``E_label ~ N @ bias``), as training
  statistics compute it;
- values given (``-b``): the bias set to them.

The least squares are the training statistics' (`mdtrain.model.stats.compute_energy_bias`:
DeePMD-kit's ``lstsq`` with the fitting's ``rcond``, types in ``atom_exclude_types``
counted as absent); the std of the residuals becomes ``out_std`` in both fitted modes.
The input file is never written: the result goes to a new file of the same kind. A
checkpoint of a run with ``training.enable_ema`` is evaluated with its averaged weights, the
model it stands for, and written back with its live weights and their average: the bias is a
buffer both share.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from mdtrain.batching import make_batch
from mdtrain.data import System
from mdtrain.data.params import ParamSpec
from mdtrain.errors import MDTrainError
from mdtrain.infer.freeze import freeze_model
from mdtrain.infer.load import is_torchscript, load_model, model_from_checkpoint
from mdtrain.infer.program import is_exported_program
from mdtrain.memory import InferenceChunker
from mdtrain.model.deepmd_file import is_dp_file, load_dp, write_dp
from mdtrain.model.files import checkpoint_io_error, has_average, load_checkpoint, model_weights
from mdtrain.model.stats import compute_energy_bias
from mdtrain.neighbors.layout import layout_of

log = logging.getLogger("mdtrain.change_bias")


def default_output(path: str) -> str:
    """DeePMD-kit's default name: ``model.pt`` → ``model_updated.pt``."""
    stem, suffix = os.path.splitext(path)
    return f"{stem}_updated{suffix}"


def read_model(path: str, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, dict]:
    """The model in ``path`` (eval mode) and what is needed to write it back: the checkpoint
    dict (a checkpoint), the ``.dp`` dict (a ``.dp``) or ``{}`` (a frozen model)."""
    if not os.path.isfile(path):
        raise MDTrainError(f"model {path}: file not found")
    if is_dp_file(path):
        state = load_dp(path)
        return model_from_checkpoint(state, f"model {path}", device).eval(), state
    if is_torchscript(path):
        return load_model(path, device), {}
    if is_exported_program(path):
        raise MDTrainError(
            f"model {path}: an exported program's weights cannot be changed; change the bias "
            "of the checkpoint it was frozen from and freeze again"
        )
    state = load_checkpoint(path, map_location="cpu")
    used = model_weights(state, source=f"model {path}")  # an EMA run's: the average
    return model_from_checkpoint(used, f"model {path}", device).eval(), state


def write_model(model: torch.nn.Module, source: str, state: dict, output: str) -> None:
    """``model`` (its bias changed) as a file of the kind ``source`` is."""
    if is_dp_file(source):
        write_dp(model, output, state.get("min_nbor_dist"))
    elif is_torchscript(source):
        freeze_model(model, output)
    else:  # the checkpoint as it was (step, optimiser, config), with the new model state
        new = dict(state)
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        if any(k.startswith("module.") for k in state["model_state"]):
            weights = {f"module.{k}": v for k, v in weights.items()}
        if has_average(state):  # evaluated with the average: the live parameters kept
            live = dict(model.named_parameters())
            weights.update(
                {k: state["model_state"][k] for k in weights if k.removeprefix("module.") in live}
            )
        new["model_state"] = weights
        tmp = f"{output}.{os.getpid()}.tmp"
        try:
            torch.save(new, tmp)
            os.replace(tmp, output)
        except OSError as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise checkpoint_io_error(output, exc) from None


def type_counts_and_energies(
    model: torch.nn.Module,
    systems: Sequence[System],
    nframes: Sequence[int],
    predict: bool,
    device: torch.device | str = "cpu",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Atoms of each type per frame (frames, ntypes), label energies and, with ``predict``,
    the model's energies (zeros otherwise), over the first ``nframes`` of each system that
    has energies."""
    counts, labels, preds = [], [], []
    chunker = InferenceChunker(device=device)
    rcut, sel = float(model.rcut), [int(s) for s in model.sel]
    params = ParamSpec.of_model(model)
    layout = layout_of(model)
    for system, n in zip(systems, nframes, strict=True):
        if not system.has("energy"):
            log.warning("%s: no energy labels, not used for the bias", system.path)
            continue
        per_type = np.bincount(system.atype, minlength=model.ntypes)[: model.ntypes]
        counts.append(np.tile(per_type, (n, 1)).astype(np.float64))
        labels.append(system.frames(np.arange(n), labels=("energy",), positions=False)["energy"])
        if not predict:
            preds.append(np.zeros(n))
            continue

        def run(start: int, stop: int, s=system) -> np.ndarray:
            batch = make_batch(
                s, np.arange(start, stop), rcut, sel, device, layout=layout, params=params
            )
            with torch.no_grad():
                out = model(*batch.inputs())
            return out["energy"].detach().cpu().numpy()

        preds.append(np.concatenate(chunker.run_all(run, n, system.natoms, name=system.path)))
    if not counts:
        raise MDTrainError("change-bias: no system has energy labels (energy.npy)")
    return np.concatenate(counts), np.concatenate(labels), np.concatenate(preds)


def fit_bias(
    model: torch.nn.Module,
    systems: Sequence[System],
    nframes: Sequence[int],
    mode: str,
    device: torch.device | str = "cpu",
) -> tuple[np.ndarray, np.ndarray]:
    """The new ``(bias, std)`` per type in ``mode`` ``change`` or ``set`` (module docstring)."""
    if mode not in ("change", "set"):
        raise MDTrainError(f"-m/--mode must be change or set, got {mode!r}")
    counts, energies, predicted = type_counts_and_energies(
        model, systems, nframes, mode == "change", device
    )
    keep = model.atom_keep.cpu().numpy()
    rcond = model.get_model_config()["fitting_net"].get("rcond")
    fitted, std = compute_energy_bias(counts * keep, energies - predicted, rcond)
    if mode == "change":
        fitted = model.out_bias.detach().cpu().numpy() + fitted
    return fitted, std


def given_bias(model: torch.nn.Module, values: Sequence[float]) -> np.ndarray:
    """``-b`` values, one per element of the model's type_map."""
    if len(values) != model.ntypes:
        raise MDTrainError(
            f"-b/--bias-value: {len(values)} values, but the model's type_map "
            f"{list(model.type_map)} has {model.ntypes} elements"
        )
    return np.asarray(values, dtype=np.float64)
