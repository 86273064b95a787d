"""``mdtrain train --finetune`` against ``dp --pt train --finetune`` (DeePMD-kit 3.2, PyTorch
backend) from the same pretrained model with a hybrid descriptor (se_e2_a + se_e2_r), on data
whose energies are shifted per element: after one step
at a learning rate of 1e-30 both fine-tuned models predict the same energies and forces
(``test -d`` files, to 1e-10), so their bias refits (``change-by-statistic``) agree.

DeePMD-kit fine-tunes only from its own checkpoints: the pretrained ``.dp`` is converted
(``dp convert-backend``) and made a checkpoint by a one-step ``--init-frz-model`` run at the
same learning rate. It refuses a type_map change for se_e2_a and for a pair table, so the
type_map stays. A ``linear_ener`` model is not compared: ``dp convert-backend`` of its ``.dp``
fails in DeePMD-kit 3.2, so its PyTorch backend has no checkpoint to fine-tune from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mdtrain.cli import main
from tests.helpers.training import make_project

pytestmark = pytest.mark.interop

HYBRID = {
    "type": "hybrid",
    "list": [
        {"type": "se_e2_a", "sel": [8, 28], "rcut": 2.5, "rcut_smth": 0.4, "neuron": [4, 8],
         "axis_neuron": 4, "seed": 1},
        {"type": "se_e2_r", "sel": [16, 24], "rcut": 3.5, "rcut_smth": 0.5, "neuron": [3, 6],
         "type_one_side": True, "seed": 2},
    ],
}  # fmt: skip


def _project(root: Path) -> Path:
    inp = make_project(root, numb_steps=3)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"] = HYBRID
    inp.write_text(json.dumps(config))
    return inp


def _shifted_data(root: Path) -> None:
    """``new/<system>``: the project's systems with 0.5 eV per O and 0.1 eV per H added."""
    for name in ("train_a", "train_b", "valid"):
        dst = root / "new" / name
        shutil.copytree(root / "data" / name, dst)
        types = np.loadtxt(dst / "type.raw", dtype=int)
        energy = np.load(dst / "set.000" / "energy.npy")
        shift = 0.5 * np.count_nonzero(types == 0) + 0.1 * np.count_nonzero(types == 1)
        np.save(dst / "set.000" / "energy.npy", energy + shift)


def _input(config: dict, data: str, path: Path) -> Path:
    """One step at a learning rate of 1e-30 on ``data``; every frame once in the statistics
    (4 batches of 2 frames per training system, both tools' sampling)."""
    config = json.loads(json.dumps(config))
    config["model"]["data_stat_nbatch"] = 4
    for key in ("training_data", "validation_data"):
        systems = config["training"][key]["systems"]
        config["training"][key]["systems"] = [s.replace("data/", f"{data}/") for s in systems]
    config["training"].update(numb_steps=1, save_freq=1, disp_freq=1)
    config["learning_rate"] = {"type": "exp", "start_lr": 1e-30, "stop_lr": 1e-31, "decay_steps": 1}
    path.write_text(json.dumps(config, indent=1))
    return path


def test_hybrid_finetune_equals_deepmd(tmp_path, monkeypatch, deepmd_pt):
    inp = _project(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "pre"]) == 0
    assert main(["freeze", "pre/model.ckpt.pt", "-o", "pre.dp"]) == 0
    _shifted_data(tmp_path)
    config = json.loads(inp.read_text())
    ours = _input(config, "new", tmp_path / "ours.json")
    assert main(["train", str(ours), "--finetune", "pre.dp", "-o", "ours"]) == 0
    assert main(["test", "-m", "ours/model.ckpt.pt", "-s", "new/valid", "-d", "ours"]) == 0
    run = deepmd_pt.dp_cmd
    run(["convert-backend", "pre.dp", "pre.pth"], tmp_path)
    (tmp_path / "init").mkdir()
    (tmp_path / "ft").mkdir()
    _input(config, "../data", tmp_path / "init" / "in.json")
    run(["--pt", "train", "in.json", "--init-frz-model", "../pre.pth"], tmp_path / "init")
    _input(config, "../new", tmp_path / "ft" / "in.json")
    log = run(["--pt", "train", "in.json", "--finetune", "../init/model.ckpt.pt"], tmp_path / "ft")
    assert "Change output bias" in log
    run(["--pt", "freeze", "-o", "ft.pth"], tmp_path / "ft")
    run(["--pt", "test", "-m", "ft/ft.pth", "-s", "new/valid", "-d", "dp"], tmp_path)
    for out in ("e", "f"):
        theirs = np.loadtxt(tmp_path / f"dp.{out}.out")
        np.testing.assert_allclose(np.loadtxt(tmp_path / f"ours.{out}.out"), theirs, atol=1e-10)
    # the refit moved the energies: not two unchanged models compared
    assert main(["test", "-m", "pre.dp", "-s", "new/valid", "-d", "old"]) == 0
    old, ours = np.loadtxt(tmp_path / "old.e.out"), np.loadtxt(tmp_path / "ours.e.out")
    assert np.abs(old[:, 1] - ours[:, 1]).min() > 1e-3
