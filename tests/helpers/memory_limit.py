"""Training under a real address-space limit (``RLIMIT_AS`` in a child process): every
allocation past the limit fails for real, wherever it happens (torch's allocator, the compiled
kernels, numpy, the BLAS, the optimiser), not only where a test injects a failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.helpers.datagen import lj_labels, write_npy_system

# Imports everything a training run uses, spawns torch's threads and loads the compiled
# kernels, measures the address space, sets the limit (base + fraction × growth), then trains.
_CHILD = """
import json, resource, sys
import torch
import torch._dynamo  # noqa: F401  (imported lazily by torch.optim: code, not data)
from mdtrain.cli import main
import mdtrain.commands.train, mdtrain.train.run, mdtrain.model.backend  # noqa: F401
from mdtrain.model.backend import build_model

def status(key):
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith(key))

torch.set_num_threads(2)
torch.ones(512, 512) @ torch.ones(512, 512)  # torch's thread pool exists before measuring
build_model({"type_map": ["A"], "descriptor": {"sel": [4]}, "fitting_net": {}})  # kernels
base = status("VmSize:")
config, out, fraction, growth = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
if fraction > 0:
    limit = base + int(fraction * growth)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
code = main(["train", config, "-o", out])
print(json.dumps({"code": code, "growth": status("VmPeak:") - base}))
"""


def write_alloy_project(root: Path, batch_size: int = 16, numb_steps: int = 4) -> Path:
    """A periodic 32-atom two-element fcc crystal (jiggled), 32 labelled frames, and an input
    whose batch needs several times the memory of one frame (validation batches twice that);
    returns the input path."""
    rng = np.random.default_rng(0)
    a = 3.7
    base = np.array([[0, 0, 0], [0, 0.5, 0.5], [0.5, 0, 0.5], [0.5, 0.5, 0]])
    cells = np.array([[i, j, k] for i in range(2) for j in range(2) for k in range(2)])
    sites = ((cells[:, None, :] + base[None]) * a).reshape(-1, 3)
    types = np.array([0] * 16 + [1] * 16)
    box = np.eye(3) * 2 * a
    coords = np.stack([sites + rng.normal(0, 0.08, sites.shape) for _ in range(32)])
    boxes = np.stack([box] * len(coords))
    energy, force, virial = lj_labels(coords, types, boxes, 5.0)
    write_npy_system(root / "alloy", coords, types, ["Cu", "Au"], boxes, energy, force, virial)
    config = {
        "model": {
            "type_map": ["Cu", "Au"],
            "descriptor": {"type": "se_e2_a", "sel": [40, 40], "rcut": 5.0, "rcut_smth": 0.5,
                           "neuron": [16, 32, 64], "axis_neuron": 8, "seed": 1},
            "fitting_net": {"neuron": [64, 64, 64], "resnet_dt": True, "seed": 1},
            "data_stat_nbatch": 1,
        },
        "learning_rate": {"type": "exp", "decay_steps": 2, "start_lr": 1e-3, "stop_lr": 1e-4},
        "loss": {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1,
                 "start_pref_f": 1000, "limit_pref_f": 1},
        "training": {
            "training_data": {"systems": ["alloy"], "batch_size": batch_size},
            # validation batches twice the training batch: near the limit they need chunking
            "validation_data": {"systems": ["alloy"], "batch_size": 2 * batch_size,
                                "numb_btch": 1},
            "numb_steps": numb_steps, "seed": 3, "disp_freq": 2, "save_freq": 1000,
        },
    }  # fmt: skip
    path = root / "input.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def train_limited(config: Path, out: Path, fraction: float, growth: int) -> dict:
    """Train in a child process whose address space may grow by ``fraction × growth`` bytes
    past what an idle, warmed-up process holds (0: no limit). Returns the child's exit code,
    its address-space growth, how many out-of-memory events the controller logged, and its
    log."""
    # one malloc arena: glibc's per-thread arenas reserve 64 MiB of address space each, at
    # moments that depend on thread timing, which would make the limit's meaning vary
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(config), str(out), str(fraction), str(growth)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {"code": None}
    report["returncode"] = proc.returncode
    report["log"] = proc.stderr
    report["ooms"] = len(re.findall(r"out of memory on system", proc.stderr))
    return report


def assert_recovers_from_real_oom(config: Path, root: Path) -> None:
    """Training ``config`` under an address-space limit at 60 % of its unlimited growth runs
    out of memory at least once, recovers, and writes the unlimited run's lcurve.out."""
    reference = train_limited(config, root / "unlimited", 0.0, 0)
    assert reference["code"] == 0 and reference["ooms"] == 0, reference["log"][-3000:]
    run = train_limited(config, root / "limited", 0.6, reference["growth"])
    assert run["returncode"] == 0 and run["code"] == 0, run["log"][-3000:]
    assert run["ooms"] >= 1, run["log"][-3000:]  # the limit really cut: the batch ran split
    expected = (root / "unlimited" / "lcurve.out").read_bytes()
    assert (root / "limited" / "lcurve.out").read_bytes() == expected
