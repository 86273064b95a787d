"""Dipole and polar models written by mdtrain, evaluated by DeePMD-kit itself.

A model with random weights and non-trivial statistics, biases, ``scale`` and
``constant_matrix`` is written as ``.dp`` (``write_dp``) and evaluated by DeePMD-kit's
``DeepDipole``/``DeepPolar`` (its numpy backend): atomic and frame tensors equal mdtrain's to
1e-10 relative, on periodic water frames (atoms not sorted by type) and a cluster. And a
briefly trained model, converted by ``dp convert-backend model.dp model.pth``, gets from
``dp --pt test`` the frame RMSE that ``mdtrain test`` prints.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.model.deepmd_file import write_dp
from tests.helpers.datagen import random_water_like
from tests.helpers.deepmd import frames_npz, rel_diff
from tests.helpers.models import TENSOR_DESCRIPTORS, evaluate, make_tensor_model
from tests.helpers.training import make_tensor_project

pytestmark = pytest.mark.interop

CASES = {
    "dipole": ("dipole", {}),
    "dipole_sel_type": ("dipole", {"sel_type": [0]}),
    "polar_full": ("polar", {"fit_diag": False, "scale": [0.7, 1.3]}),
    "polar_diag": ("polar", {"fit_diag": True, "sel_type": [0], "shift_diag": True}),
    # type-mixed descriptors: one fitting net for all types, se_atten's rotation matrix
    "dipole-se_atten": ("dipole", {"descriptor": "se_atten"}),
    "polar_full-se_atten_v2": ("polar", {"fit_diag": False, "descriptor": "se_atten_v2"}),
    "dipole-hybrid-mixed": ("dipole", {"sel_type": [0], "descriptor": "hybrid-mixed"}),
    "polar_diag-hybrid-mixed": ("polar", {"scale": [0.7, 1.3], "descriptor": "hybrid-mixed"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_deepmd_evaluates_the_tensor_export_as_mdtrain(deepmd, tmp_path, name):
    kind, fit = CASES[name]
    model = make_tensor_model(kind, seed=5, **fit).eval()
    write_dp(model, tmp_path / "model.dp")
    groups = {
        "periodic": random_water_like(2, 6, 6.0, seed=8),
        "cluster": (*random_water_like(2, 4, 6.0, seed=9)[:2], None),
    }
    job = {"evaluate_tensor": []}
    for group, (coord, atype, box) in groups.items():
        frames_npz(tmp_path / f"{group}.npz", coord, atype, box)
        job["evaluate_tensor"].append(
            {"kind": kind, "model": "model.dp", "frames": f"{group}.npz", "out": f"{group}-dp.npz"}
        )
    errors = deepmd.driver(job, tmp_path)
    assert not errors, errors
    worst = {}
    for group, (coord, atype, box) in groups.items():
        theirs = np.load(tmp_path / f"{group}-dp.npz")
        assert list(theirs["sel_type"]) == model.sel_type()
        out = [
            evaluate(model, c, None if box is None else box[f], atype) for f, c in enumerate(coord)
        ]
        atomic = np.stack([o[f"atom_{model.label}"] for o in out])
        total = np.stack([o[model.label] for o in out])
        worst[(group, "atomic")] = rel_diff(atomic, theirs["atomic"])
        worst[(group, "global")] = rel_diff(total, theirs["global"])
    print(name, {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) < 1e-10, worst


TRAINED = [
    ("dipole", "Dipole", "se_e2_a"),
    ("polar", "Polarizability", "se_e2_a"),
    ("dipole", "Dipole", "se_atten"),
    ("polar", "Polarizability", "hybrid-mixed"),
]


@pytest.mark.parametrize(("kind", "printed", "descriptor"), TRAINED)
def test_dp_test_prints_the_figures_of_mdtrain_test(
    deepmd_pt, tmp_path, monkeypatch, kind, printed, descriptor
):
    desc = TENSOR_DESCRIPTORS[descriptor]
    inp = make_tensor_project(tmp_path, kind, numb_steps=20, descriptor=desc)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "out"]) == 0
    assert main(["freeze", "-c", "out/model.ckpt.pt", "-o", "model.dp"]) == 0
    deepmd_pt.dp_cmd(["convert-backend", "model.dp", "model.pth"], tmp_path)
    dp_test = deepmd_pt.dp_cmd(["--pt", "test", "-m", "model.pth", "-s", "data/valid"], tmp_path)
    assert main(["test", "-m", "model.dp", "-s", "data/valid", "--json", "mt.json"]) == 0
    label = "dipole" if kind == "dipole" else "polarizability"
    figures = json.loads((tmp_path / "mt.json").read_text())["total"]
    dp_atomic = deepmd_pt.dp_cmd(
        ["--pt", "test", "-m", "model.pth", "-s", "data/valid", "-a"], tmp_path
    )  # atomic labels, over the atoms of sel_type
    for output, key in ((dp_test, f"{label}_rmse"), (dp_atomic, f"atomic_{label}_rmse")):
        theirs = re.findall(rf"{printed}\s+RMSE\s*:\s*(\S+)", output)
        assert theirs, f"no {printed} RMSE in dp test's output"
        print(kind, key, "mdtrain", figures[key], "dp --pt test", theirs[-1])
        assert figures[key] == pytest.approx(float(theirs[-1]), rel=1e-6)


@pytest.mark.parametrize("kind", ["dipole", "polar"])
def test_dp_test_writes_the_detail_files_of_mdtrain_test(deepmd_pt, tmp_path, monkeypatch, kind):
    """``dp --pt test -d`` (frame tensors) and ``-a -d`` (atomic tensors of the sel_type
    atoms) on the converted ``.dp``, two systems each: the same files (``p.out``,
    ``p.out.1``), headers identical, columns equal to 1e-10."""
    inp = make_tensor_project(tmp_path, kind, numb_steps=4)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "out"]) == 0
    assert main(["freeze", "-c", "out/model.ckpt.pt", "-o", "model.dp"]) == 0
    deepmd_pt.dp_cmd(["convert-backend", "model.dp", "model.pth"], tmp_path)
    worst = {}
    for layout, extra, systems in (
        ("frame", [], ["data/valid", "data/global"]),
        ("atomic", ["-a"], ["data/valid", "data/atomic"]),
    ):
        for who in ("md", "dp"):
            (tmp_path / layout / who).mkdir(parents=True)
        (tmp_path / f"{layout}.txt").write_text("\n".join(systems) + "\n")
        prefix = f"{layout}/dp/p"
        dp_args = ["--pt", "test", "-m", "model.pth", "-f", f"{layout}.txt", "-d", prefix]
        deepmd_pt.dp_cmd([*dp_args, *extra], tmp_path)
        args = ["test", "-m", "model.dp", "-s", *systems, "-d", f"{layout}/md/p", *extra]
        assert main(args) == 0
        ours = sorted(p.name for p in (tmp_path / layout / "md").iterdir())
        assert ours == sorted(p.name for p in (tmp_path / layout / "dp").iterdir())
        assert ours == ["p.out", "p.out.1"]
        for name in ours:
            mine, theirs = tmp_path / layout / "md" / name, tmp_path / layout / "dp" / name
            assert mine.read_text().splitlines()[0] == theirs.read_text().splitlines()[0]
            a, b = np.loadtxt(mine, ndmin=2), np.loadtxt(theirs, ndmin=2)
            assert a.shape == b.shape and a.shape[0] == 6, (layout, name)
            half = a.shape[1] // 2
            np.testing.assert_array_equal(a[:, :half], b[:, :half])  # the labels
            worst[(layout, name)] = float(np.abs(a - b).max())
    print(kind, {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) < 1e-10, worst
