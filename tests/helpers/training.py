"""A tiny training project (systems + input.json) that trains in seconds, for training tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from tests.helpers.datagen import water_labeled, write_npy_system


def tiny_config(**training: object) -> dict:
    """A DeePMD-style input with small networks; ``training`` keys override the defaults."""
    config = {
        "model": {
            "type_map": ["O", "H"],
            "descriptor": {
                "type": "se_e2_a",
                "sel": "auto",
                "rcut": 4.0,
                "rcut_smth": 0.5,
                "neuron": [4, 8],
                "axis_neuron": 4,
                "type_one_side": True,
                "seed": 1,
            },
            "fitting_net": {"neuron": [16, 16], "resnet_dt": True, "seed": 1},
            "data_stat_nbatch": 2,
        },
        "learning_rate": {"type": "exp", "start_lr": 1e-3, "stop_lr": 1e-5, "decay_steps": 2},
        "loss": {
            "type": "ener",
            "start_pref_e": 0.02,
            "limit_pref_e": 1,
            "start_pref_f": 1000,
            "limit_pref_f": 1,
            "start_pref_v": 0.02,
            "limit_pref_v": 1,
        },
        "training": {
            "training_data": {"systems": ["data/train_a", "data/train_b"], "batch_size": 2},
            "validation_data": {"systems": ["data/valid"], "batch_size": 2, "numb_btch": 1},
            "numb_steps": 6,
            "seed": 7,
            "disp_freq": 2,
            "save_freq": 3,
        },
    }
    config["training"].update(training)
    return config


def make_project(root: str | os.PathLike, **training: object) -> Path:
    """Write three small labelled systems (two sizes) and ``input.json``; return the input path."""
    root = Path(root)
    for name, nframes, nmol, seed in (
        ("train_a", 8, 6, 1),
        ("train_b", 8, 8, 2),
        ("valid", 4, 6, 3),
    ):
        write_npy_system(root / "data" / name, **water_labeled(nframes, nmol, 6.0, seed))
    path = root / "input.json"
    path.write_text(json.dumps(tiny_config(**training), indent=1))
    return path


def mdtrain_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mdtrain", *args]


def load_params(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    state = torch.load(path, weights_only=True)
    return state["model_state"]


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


def lcurve_rows(path: str | os.PathLike) -> np.ndarray:
    return np.loadtxt(path, ndmin=2)
