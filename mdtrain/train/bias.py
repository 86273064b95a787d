"""The energy bias refitted to data by a trained model, as DeePMD-kit's ``change-by-statistic``
does: the model predicts the frames sampled for the statistics, and the least-squares
per-type correction of ``label − prediction`` (``compute_energy_bias``) is added to the bias.

Used after fine-tuning starts (`mdtrain.train.finetune`) and after the last step when
``training.change_bias_after_training`` is on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mdtrain.model.stats import collect_stat_batches, compute_energy_bias, stat_inputs

log = logging.getLogger("mdtrain")


def predicted_energies(model: torch.nn.Module, batches: list[dict[str, Any]]) -> np.ndarray:
    """The model's energies of the sampled frames that have an energy label."""
    device = model.out_bias.device
    out = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in batches:
            if "energy" not in batch:
                continue
            coord, box, atype, nlist, shift = stat_inputs(batch, 0, len(batch["coord"]), device)
            params = [
                None if p is None else torch.as_tensor(p, dtype=torch.float64, device=device)
                for p in batch.get("params", ())
            ]
            out.append(model(coord, atype, box, nlist, shift, *params)["energy"].cpu().numpy())
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros(0)


def refit_energy_bias(model: torch.nn.Module, systems: Sequence[Any], nbatch: int) -> bool:
    """Add the least-squares correction of the residuals on ``nbatch`` sampled batches of
    every system to ``model``'s energy bias; False (bias kept) when no frame has an energy.
    A combined model (DP+ZBL, ``linear_ener``) is evaluated whole on its own neighbour
    list and its one bias refitted, as DeePMD-kit's ``change_out_bias`` of a linear model."""
    cut = (float(model.rcut), [int(s) for s in model.sel], bool(model.mixed_types))
    config = model.get_model_config()
    batches = collect_stat_batches(systems, config, nbatch, cut=cut)
    energies = [b["energy"] for b in batches if "energy" in b]
    if not energies:
        return False
    counts = np.concatenate(
        [np.tile(b["natoms_per_type"], (len(b["energy"]), 1)) for b in batches if "energy" in b]
    ).astype(np.float64)
    residual = np.concatenate(energies) - predicted_energies(model, batches)
    keep = model.atom_keep.cpu().numpy()
    rcond = (config.get("fitting_net") or {}).get("rcond")  # a linear model's: None
    delta, _ = compute_energy_bias(counts * keep, residual, rcond)
    model.set_out_bias(model.out_bias.detach().cpu().numpy() + delta)
    return True


def bias_text(model: torch.nn.Module) -> str:
    """``"O -93.6, H -187.2"``: the energy bias per element, for the log."""
    return ", ".join(
        f"{t} {b:.6g}" for t, b in zip(model.type_map, model.out_bias.tolist(), strict=True)
    )
