"""Data the project makes for DOS and property models: labels that depend only on each atom's
environment (so they are invariant under rotation, translation and permutation, as the
models' outputs are), and a small project (systems + ``input.json``) of each kind.

Per atom ``i`` with neighbours ``j`` at distances ``r_ij`` within ``CUT`` (minimum image in a
cubic cell), smooth weights ``s(r) = (1 + cos(pi r / CUT)) / 2``:

- atomic DOS on the grid ``e_k`` (``numb_dos`` points in [0.5, 3.5]):
  ``sum_j s(r_ij) exp(-(e_k - r_ij)^2 / 0.18) + w_t exp(-(e_k - 2)^2 / 0.5)``,
  ``w_t`` 1.0 for O and 0.5 for H; the frame DOS is the sum over atoms;
- atomic property (2 values): ``c_i = sum_j s(r_ij)`` and ``c_i^2 / 4 + t_i``; the frame
  property is their mean over atoms (intensive) or sum.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tests.helpers.datagen import random_water_like, write_npy_system
from tests.helpers.training import tiny_config

CUT = 2.9  # below half the 6 Å cells: the minimum image is exact


def _weights(coords: np.ndarray, box_len: float) -> tuple[np.ndarray, np.ndarray]:
    """Distances (nf, N, N) and smooth weights (zero on the diagonal and beyond CUT)."""
    diff = coords[:, None, :, :] - coords[:, :, None, :]
    diff -= box_len * np.round(diff / box_len)
    r = np.linalg.norm(diff, axis=-1)
    inside = (r < CUT) & (r > 1e-8)
    return r, np.where(inside, 0.5 * (1 + np.cos(np.pi * r / CUT)), 0.0)


def dos_labels(coords, types, box_len: float, numb_dos: int) -> dict[str, np.ndarray]:
    """``dos`` (nf, numb_dos) and ``atom_dos`` (nf, N, numb_dos), atoms in file order."""
    r, s = _weights(coords, box_len)
    grid = np.linspace(0.5, 3.5, numb_dos)
    peaks = np.exp(-((grid - r[..., None]) ** 2) / 0.18)  # (nf, N, N, k)
    own = np.where(types == 0, 1.0, 0.5)[None, :, None] * np.exp(-((grid - 2.0) ** 2) / 0.5)
    atomic = np.einsum("fij,fijk->fik", s, peaks) + own
    return {"dos": atomic.sum(axis=1), "atom_dos": atomic}


def property_labels(coords, types, box_len: float, name: str, intensive: bool) -> dict:
    """``<name>`` (nf, 2) and ``atom_<name>`` (nf, N, 2), atoms in file order."""
    _, s = _weights(coords, box_len)
    c = s.sum(axis=2)
    atomic = np.stack([c, c**2 / 4 + types[None, :]], axis=-1)
    total = atomic.mean(axis=1) if intensive else atomic.sum(axis=1)
    return {name: total, f"atom_{name}": atomic}


def output_model(kind: str, numb_dos: int = 8, intensive: bool = True) -> dict:
    """The ``fitting_net`` and ``loss`` sections of a small DOS or property model."""
    if kind == "dos":
        fit = {"type": "dos", "numb_dos": numb_dos, "neuron": [16, 16], "seed": 1}
        loss = {"type": "dos", "start_pref_dos": 1.0, "limit_pref_dos": 1.0}
        loss.update(start_pref_cdf=0.1, limit_pref_cdf=0.1)
        loss.update(start_pref_ados=1.0, limit_pref_ados=1.0)
        return {"fitting_net": fit, "loss": loss}
    fit = {"type": "property", "property_name": "band_prop", "task_dim": 2, "seed": 1}
    fit.update(intensive=intensive, neuron=[16, 16])
    return {"fitting_net": fit, "loss": {"type": "property", "metric": ["mae", "rmse"]}}


def make_output_project(
    root: str | os.PathLike,
    kind: str,
    numb_steps: int = 40,
    numb_dos: int = 8,
    numb_fparam: int = 0,
    numb_aparam: int = 0,
) -> Path:
    """A DOS or property project of water-like systems: for DOS a system with frame labels
    only, one with atomic ones only (as DeePMD-kit's example) and a validation system with
    both; for a property three systems with both; and ``input.json``. With ``numb_fparam``
    / ``numb_aparam`` every system also has random ``fparam.npy`` / ``aparam.npy`` (the
    labels do not depend on them) and the model takes them."""
    root = Path(root)
    parts = output_model(kind, numb_dos)
    for name, seed in (("global", 1), ("atomic", 2), ("valid", 3)):
        coords, types, boxes = random_water_like(6, 6, 6.0, seed=seed)
        if kind == "dos":
            labels = dos_labels(coords, types, 6.0, numb_dos)
            keep = {"global": ("dos",), "atomic": ("atom_dos",)}.get(name, tuple(labels))
            labels = {k: labels[k] for k in keep}
        else:
            labels = property_labels(coords, types, 6.0, "band_prop", True)
        rng = np.random.default_rng(seed + 100)
        nf, natoms = coords.shape[0], len(types)
        if numb_fparam:
            labels["fparam"] = rng.normal(1.0, 0.5, size=(nf, numb_fparam))
        if numb_aparam:
            labels["aparam"] = rng.normal(-1.0, 2.0, size=(nf, natoms * numb_aparam))
        write_npy_system(root / "data" / name, coords, types, ["O", "H"], boxes, extra=labels)
    config = tiny_config(numb_steps=numb_steps, disp_freq=numb_steps // 2, save_freq=numb_steps)
    parts["fitting_net"].update(numb_fparam=numb_fparam, numb_aparam=numb_aparam)
    config["model"]["fitting_net"] = parts["fitting_net"]
    config["loss"] = parts["loss"]
    config["learning_rate"] = {"type": "exp", "start_lr": 1e-2, "stop_lr": 1e-3, "decay_steps": 10}
    config["training"]["training_data"]["systems"] = ["data/global", "data/atomic"]
    config["training"]["validation_data"]["systems"] = ["data/valid"]
    path = root / "input.json"
    path.write_text(json.dumps(config, indent=1))
    return path
