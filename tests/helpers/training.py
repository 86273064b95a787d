"""A tiny training project (systems + input.json) that trains in seconds, for training tests;
the content hash of every file below a folder (nothing lost or changed)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from tests.helpers.datagen import (
    random_water_like,
    tensor_labels,
    water_labeled,
    write_npy_system,
)
from tests.helpers.processes import CompletedRun, free_port, run_ranks, spawn_workers


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


def train_on_ranks(
    inp: Path,
    out: str | os.PathLike,
    *extra: str,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
) -> CompletedRun:
    """``mdtrain train inp -o out extra`` on ``nproc`` Gloo ranks started as torchrun starts
    them, without its agent (``run_ranks``), in the input's folder; not yet checked."""
    cmd = mdtrain_command("train", str(inp), "-o", str(out), *extra)
    return run_ranks(cmd, nproc, timeout, env, cwd=inp.parent)


def train_runs_on_ranks(
    runs: list[tuple[Path, str | os.PathLike, tuple[str, ...], dict[str, str]]],
    nproc: int = 2,
    timeout: float = 180.0,
) -> list[str]:
    """Several ``mdtrain train inp -o out extra`` runs, one after the other, on the same
    ``nproc`` rank processes (variables as torchrun gives them, one Gloo group per run on a
    port of its own, ``env`` set for that run only), each run in its input's folder: the same
    code path as ``train_on_ranks`` (the command's ``main``), without starting (and importing
    torch in) two fresh processes per run. Fails unless every run ends with 0 on every rank;
    returns each run's stderr, the ranks' joined in rank order."""
    jobs = [
        (str(Path(inp).parent), ["train", str(inp), "-o", str(out), *extra], env or {}, free_port())
        for inp, out, extra, env in runs
    ]
    outcomes = spawn_workers(_train_runs, nproc, (jobs,), timeout * len(jobs))
    failed = [o.describe() for o in outcomes if not o.ok]
    assert not failed, "\n\n".join(failed)
    logs = [o.stderr.split(_RUN_MARK)[1:] for o in outcomes]
    return ["".join(parts) for parts in zip(*logs, strict=True)]


_RUN_MARK = "\n--- next run ---\n"


def _train_runs(jobs: list[tuple[str, list[str], dict[str, str], int]]) -> list[int]:
    """On one rank: each job's ``main`` in turn; a non-zero exit code stops the rest."""
    from mdtrain.cli import main

    for cwd, argv, env, port in jobs:
        sys.stderr.write(_RUN_MARK)
        os.chdir(cwd)
        os.environ["MASTER_PORT"] = str(port)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            code = main(argv)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        sys.stderr.flush()
        if code != 0:
            raise RuntimeError(f"{' '.join(argv)} (in {cwd}): exit code {code}")
    return [0] * len(jobs)


def load_params(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    state = torch.load(path, weights_only=True)
    return state["model_state"]


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


def lcurve_rows(path: str | os.PathLike) -> np.ndarray:
    return np.loadtxt(path, ndmin=2)


def full_validation_reference(checkpoint, system_path, live: bool = True) -> dict[str, float]:
    """What ``val.log`` should show for a checkpoint on one system, computed with numpy: MAE
    and RMSE in meV of the energy per atom, the force components and the stress (minus the
    virial over the cell volume). Full validation evaluates the live weights unless
    ``ema_full_validation``; an EMA run's checkpoint otherwise stands for its average."""
    from mdtrain.data import open_system
    from mdtrain.infer.load import load_model
    from mdtrain.infer.test import evaluate_system

    model = load_model(checkpoint, live=live)
    system = open_system(str(system_path), ["O", "H"])
    res = evaluate_system(model, system, system.nframes)
    n = system.natoms
    de = (res.pred["energy"] - res.label["energy"]) / n
    df = (res.pred["force"] - res.label["force"]).ravel()
    box = system.frames(np.arange(system.nframes))["box"]
    vol = np.abs(np.linalg.det(box))
    ds = -(res.pred["virial"] - res.label["virial"]).reshape(-1, 9) / vol[:, None]
    out = {}
    for name, d in (("E", de), ("F", df), ("S", ds)):
        out[f"{name}_MAE"] = float(np.mean(np.abs(d)) * 1000)
        out[f"{name}_RMSE"] = float(np.sqrt(np.mean(d * d)) * 1000)
    return out


def val_log_rows(path) -> dict[int, dict[str, float]]:
    """``val.log`` as ``{step: {"E_MAE": ..., ...}}`` (units dropped from the names)."""
    lines = Path(path).read_text().splitlines()
    names = [h.split("(")[0] for h in lines[0].split()[2:]]
    return {
        int(r.split()[0]): dict(zip(names, map(float, r.split()[1:]), strict=True))
        for r in lines
        if not r.startswith("#")
    }


def snapshot(directory: str | os.PathLike) -> dict[str, str]:
    """Every file (and link target) below ``directory`` with its sha256."""
    directory = Path(directory)
    found = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        if path.is_symlink():
            found[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def make_tensor_project(
    root: str | os.PathLike, kind: str, numb_steps: int = 40, descriptor: dict | None = None
) -> Path:
    """A dipole or polar project: training systems with frame labels (``dipole.npy``,
    ``polarizability.npy``) and with atomic ones, a validation system with both, and
    ``input.json`` (hydrogens excluded, as in DeePMD-kit's water_tensor examples; the
    descriptor section ``descriptor`` instead of the tiny se_e2_a when given)."""
    root = Path(root)
    for name, seed, which in (
        ("global", 1, ("dipole", "polarizability")),
        ("atomic", 2, ("atomic_dipole", "atomic_polarizability")),
        ("valid", 3, ("dipole", "polarizability", "atomic_dipole", "atomic_polarizability")),
    ):
        coords, types, boxes = random_water_like(6, 6, 6.0, seed=seed)
        labels = tensor_labels(coords, types)
        extra = {k: labels[k] for k in which}
        write_npy_system(root / "data" / name, coords, types, ["O", "H"], boxes, extra=extra)
    config = tiny_config(numb_steps=numb_steps, disp_freq=numb_steps // 2, save_freq=numb_steps)
    config["model"]["atom_exclude_types"] = [1]
    if descriptor is not None:
        config["model"]["descriptor"] = copy.deepcopy(descriptor)
    config["model"]["fitting_net"] = {"type": kind, "neuron": [16, 16], "seed": 1}
    config["loss"] = {"type": "tensor", "pref": 1.0, "pref_atomic": 1.0}
    config["learning_rate"] = {"type": "exp", "start_lr": 1e-2, "stop_lr": 1e-3, "decay_steps": 10}
    config["training"]["training_data"]["systems"] = ["data/global", "data/atomic"]
    config["training"]["validation_data"]["systems"] = ["data/valid"]
    path = root / "input.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def frozen_reports(path: Path, removed: Path | None = None) -> dict[str, dict]:
    """Train the input ``path`` into ``out/`` beside it, freeze to ``model.dp``, delete
    ``removed`` (a file neither model may need any more) and ``mdtrain test`` both on
    ``data/valid``: ``{"ckpt": figures, "dp": figures}`` (the model's path checked, dropped)."""
    from mdtrain.cli import main

    root = path.parent
    out = root / "out"
    assert main(["train", str(path), "-o", str(out)]) == 0
    ckpt, frozen = out / "model.ckpt.pt", root / "model.dp"
    assert main(["freeze", str(ckpt), "-o", str(frozen)]) == 0
    if removed is not None:
        removed.unlink()
    reports = {}
    for name, model in (("ckpt", ckpt), ("dp", frozen)):
        report = root / f"{name}.json"
        valid = str(root / "data" / "valid")
        assert main(["test", "-m", str(model), "-s", valid, "--json", str(report)]) == 0
        reports[name] = json.loads(report.read_text())
        assert reports[name].pop("model") == str(model)
    return reports


DP_TEST_PRINTED = (
    ("Energy RMSE", "energy_rmse"),
    ("Force  RMSE", "force_rmse"),
    ("Virial RMSE", "virial_rmse"),
)


def mdtrain_and_dp_test(deepmd_pt, path: Path, detail: bool = False) -> dict[str, tuple]:
    """Train the input ``path`` into ``out/``, freeze to ``model.dp``, and test it on a new
    small water system with ``mdtrain test`` and with DeePMD-kit's PyTorch backend (``dp
    convert-backend``, ``dp --pt test``; ``detail``: both write ``-d`` files ``md.*`` and
    ``dp.*``): ``{figure: (mdtrain's, the one dp test printed)}``."""
    import re

    from mdtrain.cli import main

    root = path.parent
    assert main(["train", str(path), "-o", str(root / "out")]) == 0
    model_dp = root / "model.dp"
    assert main(["freeze", str(root / "out" / "model.ckpt.pt"), "-o", str(model_dp)]) == 0
    system = write_npy_system(root / "test", **water_labeled(3, 6, 6.0, seed=42))
    figures = root / "mt.json"
    args = ["test", "-m", str(model_dp), "-s", system, "--json", str(figures)]
    assert main(args + (["-d", str(root / "md")] if detail else [])) == 0
    found = json.loads(figures.read_text())["total"]
    deepmd_pt.dp_cmd(["convert-backend", "model.dp", "model.pth"], root)
    dp_args = ["--pt", "test", "-m", "model.pth", "-s", "test"]
    dp_test = deepmd_pt.dp_cmd(dp_args + (["-d", "dp"] if detail else []), root)
    shown = {}
    for label, key in DP_TEST_PRINTED:
        printed = re.findall(rf"{label}\s*:\s*(\S+)", dp_test)
        assert printed, f"no {label!r} in dp test's output"
        shown[key] = (found[key], float(printed[-1]))
    return shown
