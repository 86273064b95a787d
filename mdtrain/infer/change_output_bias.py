"""``mdtrain change-bias`` of a DOS or property model: its atomic model's ``out_bias`` and
``out_std`` (ntypes, values per atom), as DeePMD-kit 3.2's ``change_out_bias`` sets them
(``deepmd/pt/model/atomic_model/base_atomic_model.py``, ``compute_output_stats``):

- ``set`` (``set-by-statistic``): the output statistics of the labels, as training computes
  them (`mdtrain.model.stats.output_stats`);
- ``change`` (``change-by-statistic``): the same statistics of the labels minus the model's
  predictions (frame values, and atomic values where the system has them), the bias added to
  the model's and the standard deviation replacing its own.

Values given with ``-b`` are an energy model's only (DeePMD-kit refuses them too).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mdtrain.batching import make_batch
from mdtrain.data import System
from mdtrain.data.params import ParamSpec
from mdtrain.errors import MDTrainError
from mdtrain.memory import InferenceChunker
from mdtrain.model.stats.output_stats import output_stats
from mdtrain.neighbors.layout import layout_of


def fit_output_bias(
    model: torch.nn.Module,
    systems: Sequence[System],
    nframes: Sequence[int],
    mode: str,
    device: torch.device | str = "cpu",
) -> tuple[np.ndarray, np.ndarray]:
    """The new ``(out_bias, out_std)`` (ntypes, k) of the DOS or property ``model`` in
    ``mode`` ``change`` or ``set``, from the first ``nframes`` of each system."""
    if mode not in ("change", "set"):
        raise MDTrainError(f"-m/--mode must be change or set, got {mode!r}")
    name = model.output
    if not any(s.has(name) or s.has(f"atom_{name}") for s in systems):
        raise MDTrainError(f"change-bias: no system has {name}.npy or atom_{name}.npy")
    chunker = InferenceChunker(device=device)
    rcut, sel = float(model.rcut), [int(s) for s in model.sel]
    params, layout = ParamSpec.of_model(model), layout_of(model)

    def predict(index: int, frames: list[int]) -> dict[str, np.ndarray]:
        system = systems[index]

        def run(start: int, stop: int) -> dict[str, np.ndarray]:
            rows = np.asarray(frames[start:stop])
            batch = make_batch(system, rows, rcut, sel, device, layout=layout, params=params)
            with torch.no_grad():
                out = model(*batch.inputs())
            return {k: out[k].detach().cpu().numpy() for k in (name, f"atom_{name}")}

        parts = chunker.run_all(run, len(frames), system.natoms, name=system.path)
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    plan = [(i, 0, int(n)) for i, n in enumerate(nframes) if n > 0]
    rcond = model.get_model_config()["fitting_net"].get("rcond")
    bias, std = output_stats(model, systems, plan, rcond, predict if mode == "change" else None)
    if mode == "change":
        bias = model.out_bias.detach().cpu().numpy() + bias
    return bias, std
