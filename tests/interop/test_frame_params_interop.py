"""A model with frame and atomic parameters, exported by ``mdtrain freeze`` to ``.dp``,
converted by DeePMD-kit 3.2 (``dp convert-backend model.dp model.pth``) and tested by its
PyTorch backend (``dp --pt test``) on systems with ``fparam.npy`` and ``aparam.npy``: the
same predictions (detail files to 1e-8) and RMSEs as ``mdtrain test -m model.dp``."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from tests.helpers.frame_params import PARAMS, add_params
from tests.helpers.models import make_model, save_tiny_checkpoint
from tests.helpers.training import make_project

pytestmark = pytest.mark.interop


def rmses(text: str) -> dict[str, float]:
    """Energy, force and virial RMSEs printed by ``dp test`` or ``mdtrain test``."""
    found = {}
    for name, pattern in (
        ("energy", r"Energy RMSE\s*:\s*([0-9.eE+-]+)"),
        ("force", r"Force\s+RMSE\s*:\s*([0-9.eE+-]+)"),
        ("virial", r"Virial RMSE\s*:\s*([0-9.eE+-]+)"),
    ):
        match = re.findall(pattern, text)
        if match:
            found[name] = float(match[-1])
    return found


def test_deepmd_tests_a_model_with_fparam_and_aparam_as_mdtrain(tmp_path, monkeypatch, deepmd_pt):
    make_project(tmp_path)
    for k, system in enumerate(sorted(glob.glob(str(tmp_path / "data" / "*")))):
        add_params(system, PARAMS["numb_fparam"], PARAMS["numb_aparam"], seed=20 + k)
    model = make_model(descriptor={"sel": [40, 80]}, fitting=PARAMS)
    with torch.no_grad():
        model.fitting.fparam_avg.copy_(torch.tensor([1.0, -2.0], dtype=torch.float64))
        model.fitting.fparam_inv_std.copy_(torch.tensor([3.0, 4.0], dtype=torch.float64))
        model.fitting.aparam_avg.fill_(0.5)
        model.fitting.aparam_inv_std.fill_(3.5)
    checkpoint = save_tiny_checkpoint(tmp_path / "model.pt", model)
    monkeypatch.chdir(tmp_path)
    assert main(["freeze", checkpoint, "-o", "model.dp"]) == 0
    system = "data/valid"
    (tmp_path / "mdtrain").mkdir()
    assert main(["test", "-m", "model.dp", "-s", system, "-d", "mdtrain/p"]) == 0
    deepmd_pt.dp_cmd(["convert-backend", "model.dp", "model.pth"], tmp_path)
    (tmp_path / "dp").mkdir()
    printed = deepmd_pt.dp_cmd(
        ["--pt", "test", "-m", "model.pth", "-s", system, "-d", "dp/p"], tmp_path
    )
    for suffix in ("e", "f", "v"):
        a = np.loadtxt(Path("mdtrain") / f"p.{suffix}.out")
        b = np.loadtxt(Path("dp") / f"p.{suffix}.out")
        assert a.shape == b.shape and a.shape[0] > 1, suffix
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-8, err_msg=suffix)
    theirs = rmses(printed)
    assert set(theirs) == {"energy", "force", "virial"}, printed[-2000:]
    # the same RMSEs from mdtrain's detail files (its printed table rounds differently)
    e = np.loadtxt(Path("mdtrain") / "p.e.out")
    f = np.loadtxt(Path("mdtrain") / "p.f.out")
    ours = {
        "energy": float(np.sqrt(np.mean((e[:, 0] - e[:, 1]) ** 2))),
        "force": float(np.sqrt(np.mean((f[:, :3] - f[:, 3:]) ** 2))),
    }
    for key, value in ours.items():
        assert theirs[key] == pytest.approx(value, rel=1e-5), key
    # the parameters change the predictions: without them the model is another one
    assert np.abs(e[:, 1] - e[:, 1].mean()).max() > 0
