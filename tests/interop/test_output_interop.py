"""DOS and property models trained by mdtrain, evaluated by DeePMD-kit itself: a briefly
trained model is frozen to ``.dp``, converted by ``dp convert-backend model.dp model.pth``,
and ``dp --pt test`` prints the figures ``mdtrain test`` prints (DOS MAE/RMSE and their
per-atom forms; PROPERTY MAE/RMSE), for an se_e2_a DOS model and property models on se_e2_a
and on dpa1 (a type-embedding descriptor)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from mdtrain.cli import main
from tests.helpers.output_data import make_output_project

pytestmark = pytest.mark.interop

DPA1 = {
    "type": "dpa1",
    "sel": 40,
    "rcut": 4.0,
    "rcut_smth": 0.5,
    "neuron": [4, 8],
    "axis_neuron": 4,
    "tebd_dim": 4,
    "attn": 8,
    "attn_layer": 1,
    "seed": 1,
}
# dp test's line -> mdtrain test's JSON key
FIGURES = {
    "dos": {
        "DOS MAE": "dos_mae",
        "DOS RMSE": "dos_rmse",
        "DOS MAE/Natoms": "dos_mae_per_atom",
        "DOS RMSE/Natoms": "dos_rmse_per_atom",
    },
    "property": {"PROPERTY MAE": "property_mae", "PROPERTY RMSE": "property_rmse"},
}


@pytest.mark.parametrize(
    ("kind", "descriptor"), [("dos", None), ("property", None), ("property", DPA1)]
)
def test_dp_test_prints_the_figures_of_mdtrain_test(
    deepmd_pt, tmp_path, monkeypatch, kind, descriptor
):
    inp = make_output_project(tmp_path, kind, numb_steps=20)
    if descriptor is not None:
        config = json.loads(inp.read_text())
        config["model"]["descriptor"] = descriptor
        inp.write_text(json.dumps(config, indent=1))
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "out"]) == 0
    assert main(["freeze", "-c", "out/model.ckpt.pt", "-o", "model.dp"]) == 0
    deepmd_pt.dp_cmd(["convert-backend", "model.dp", "model.pth"], tmp_path)
    dp_test = deepmd_pt.dp_cmd(["--pt", "test", "-m", "model.pth", "-s", "data/valid"], tmp_path)
    assert main(["test", "-m", "model.dp", "-s", "data/valid", "--json", "mt.json"]) == 0
    ours = json.loads((tmp_path / "mt.json").read_text())["total"]
    for line, key in FIGURES[kind].items():
        theirs = re.findall(rf"{re.escape(line)}\s*:\s*(\S+)", dp_test)
        assert theirs, f"no {line!r} in dp test's output"
        print(kind, line, "mdtrain", ours[key], "dp --pt test", theirs[-1])
        assert ours[key] == pytest.approx(float(theirs[-1]), rel=1e-6)


@pytest.mark.parametrize("kind", ["dos", "property"])
def test_parameters_and_detail_files_agree_with_dp_test(deepmd_pt, tmp_path, monkeypatch, kind):
    """A model with frame and atomic parameters (``numb_fparam`` 2, ``numb_aparam`` 1):
    ``dp --pt test -a -d`` on the converted ``.dp`` prints mdtrain's figures and writes the
    per-frame detail files (frame and atomic values) ``mdtrain test -d`` writes, to 1e-10."""
    inp = make_output_project(tmp_path, kind, numb_steps=10, numb_fparam=2, numb_aparam=1)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "out"]) == 0
    assert main(["freeze", "-c", "out/model.ckpt.pt", "-o", "model.dp"]) == 0
    deepmd_pt.dp_cmd(["convert-backend", "model.dp", "model.pth"], tmp_path)
    dp_args = ["--pt", "test", "-m", "model.pth", "-s", "data/valid", "-d", "dp/detail.txt", "-a"]
    (tmp_path / "dp").mkdir()
    dp_test = deepmd_pt.dp_cmd(dp_args, tmp_path)
    args = ["test", "-m", "model.dp", "-s", "data/valid", "-d", "md/detail.txt"]
    (tmp_path / "md").mkdir()
    assert main([*args, "--json", "mt.json"]) == 0
    ours = json.loads((tmp_path / "mt.json").read_text())["total"]
    for line, key in FIGURES[kind].items():
        theirs = re.findall(rf"{re.escape(line)}\s*:\s*(\S+)", dp_test)
        assert theirs, f"no {line!r} in dp test's output"
        assert ours[key] == pytest.approx(float(theirs[-1]), rel=1e-6)
    suffixes = ("dos", "ados") if kind == "dos" else ("property", "aproperty")
    theirs = sorted(p.name for s in suffixes for p in (tmp_path / "dp").glob(f"detail.{s}.out.*"))
    assert len(theirs) == 12  # 6 frames, frame and atomic values (dp test -a)
    for name in theirs:
        a, b = tmp_path / "dp" / name, tmp_path / "md" / name
        assert a.read_text().splitlines()[0] == b.read_text().splitlines()[0]
        np.testing.assert_allclose(np.loadtxt(b), np.loadtxt(a), rtol=0, atol=1e-10)
