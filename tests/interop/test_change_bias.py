"""``mdtrain change-bias -m change`` against ``dp --pt change-bias -m change`` (DeePMD-kit 3.2,
PyTorch backend) on the same ``.dp`` model and systems: the two refitted models predict the
same energies (to 1e-8 eV), read from both tools' ``test -d`` files."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.cli import main
from tests.helpers.models import make_model, save_tiny_checkpoint
from tests.helpers.training import make_project

pytestmark = pytest.mark.interop


def test_change_bias_equals_deepmd(tmp_path, monkeypatch, deepmd_pt):
    make_project(tmp_path)
    model = make_model(descriptor={"sel": [40, 80]})
    checkpoint = save_tiny_checkpoint(tmp_path / "model.pt", model)
    monkeypatch.chdir(tmp_path)
    assert main(["freeze", checkpoint, "-o", "model.dp"]) == 0
    assert main(["change-bias", "model.dp", "-s", "data", "-o", "ours.dp"]) == 0
    assert main(["test", "-m", "ours.dp", "-s", "data/valid", "-d", "ours"]) == 0
    deepmd_pt.dp_cmd(["convert-backend", "model.dp", "model.pth"], tmp_path)
    deepmd_pt.dp_cmd(["--pt", "change-bias", "model.pth", "-s", "data", "-o", "dp.pth"], tmp_path)
    deepmd_pt.dp_cmd(["--pt", "test", "-m", "dp.pth", "-s", "data/valid", "-d", "dp"], tmp_path)
    ours, theirs = np.loadtxt(tmp_path / "ours.e.out"), np.loadtxt(tmp_path / "dp.e.out")
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-8)
    # the refit moved the energies: the comparison is not of two unchanged models
    assert main(["test", "-m", "model.dp", "-s", "data/valid", "-d", "old"]) == 0
    assert np.abs(np.loadtxt(tmp_path / "old.e.out")[:, 1] - ours[:, 1]).min() > 1e-3
