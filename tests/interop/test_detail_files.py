"""``mdtrain test -d`` against ``dp --pt test -d`` (DeePMD-kit 3.2, PyTorch backend): the same
``.dp`` model and frames give the same detail files, headers identical and columns equal to
1e-8, two systems appended as DeePMD-kit appends them (one header, in the first system's
name), atoms in the files' order (the water systems interleave O and H)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mdtrain.cli import main
from tests.helpers.models import make_model, save_tiny_checkpoint
from tests.helpers.training import make_project

pytestmark = pytest.mark.interop

SUFFIXES = ("e", "e_peratom", "f", "v", "v_peratom", "s")


def headers(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("#")]


def test_detail_files_equal_deepmd(tmp_path, monkeypatch, deepmd_pt):
    make_project(tmp_path)
    model = make_model(descriptor={"sel": [40, 80]})  # no neighbour left out by sel
    checkpoint = save_tiny_checkpoint(tmp_path / "model.pt", model)
    monkeypatch.chdir(tmp_path)
    assert main(["freeze", checkpoint, "-o", "model.dp"]) == 0
    systems = ["data/valid", "data/train_a"]
    (tmp_path / "mdtrain").mkdir()
    assert main(["test", "-m", "model.dp", "-s", *systems, "-d", "mdtrain/p"]) == 0

    deepmd_pt.dp_cmd(["convert-backend", "model.dp", "model.pth"], tmp_path)
    (tmp_path / "systems.txt").write_text("\n".join(systems) + "\n")
    (tmp_path / "dp").mkdir()
    deepmd_pt.dp_cmd(
        ["--pt", "test", "-m", "model.pth", "-f", "systems.txt", "-d", "dp/p"], tmp_path
    )
    for suffix in SUFFIXES:
        ours, theirs = tmp_path / "mdtrain" / f"p.{suffix}.out", tmp_path / "dp" / f"p.{suffix}.out"
        assert headers(ours) == headers(theirs) and len(headers(ours)) == 1, suffix
        assert headers(ours)[0].startswith("# data/valid")
        a, b = np.loadtxt(ours), np.loadtxt(theirs)
        assert a.shape == b.shape and a.shape[0] > 1, suffix
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-8, err_msg=suffix)
