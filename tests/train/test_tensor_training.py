"""Dipole and polar models end to end on data the project makes itself: ``mdtrain check``,
``mdtrain train`` (the validation error falls), ``mdtrain freeze -o model.dp`` (reads back to
the checkpoint's numbers) and ``mdtrain test`` (its JSON figures are the errors recomputed
here from the model's own outputs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.infer.load import load_model
from tests.helpers.models import evaluate
from tests.helpers.training import lcurve_rows, make_tensor_project


@pytest.mark.parametrize(("kind", "label"), [("dipole", "dipole"), ("polar", "polarizability")])
def test_train_freeze_and_test_a_tensor_model(tmp_path, monkeypatch, kind, label):
    inp = make_tensor_project(tmp_path, kind)
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(inp)]) == 0
    out = tmp_path / "out"
    assert main(["train", str(inp), "-o", str(out)]) == 0
    header = (out / "lcurve.out").read_text().splitlines()[0]
    name = "dipole" if kind == "dipole" else "polar"
    assert f"rmse_local_{name}_val" in header and f"rmse_global_{name}_val" in header
    rows = lcurve_rows(out / "lcurve.out")
    assert rows[-1, 1] < rows[0, 1]  # the validation loss falls
    assert main(["freeze", "-c", str(out / "model.ckpt.pt"), "-o", str(tmp_path / "m.dp")]) == 0
    frozen = load_model(tmp_path / "m.dp")
    trained = load_model(out / "model.ckpt.pt")
    system = open_system(str(tmp_path / "data" / "valid"), ["O", "H"])
    frames = system.frames(range(system.nframes))
    ours = [evaluate(frozen, c, b, system.atype) for c, b in zip(frames["coord"], frames["box"])]
    ref = [evaluate(trained, c, b, system.atype) for c, b in zip(frames["coord"], frames["box"])]
    atomic = np.stack([o[f"atom_{label}"] for o in ours])
    assert np.array_equal(atomic, np.stack([o[f"atom_{label}"] for o in ref]))
    assert main(["test", "-m", str(tmp_path / "m.dp"), "-s", "data/valid", "--json", "t.json"]) == 0
    figures = json.loads((tmp_path / "t.json").read_text())["total"]
    total = np.stack([o[label] for o in ours])
    want_global = np.sqrt(np.mean((total - frames[label]) ** 2))
    diff = atomic - frames[f"atomic_{label}"].reshape(atomic.shape)
    want_atomic = np.sqrt(np.mean(diff[:, system.atype == 0] ** 2))  # sel_type's, as dp test -a
    assert figures[f"{label}_rmse"] == pytest.approx(want_global, rel=1e-12)
    assert figures[f"atomic_{label}_rmse"] == pytest.approx(want_atomic, rel=1e-12)


def _keep_selected_atoms(system: Path) -> None:
    """Rewrite a system's atomic tensor files with the oxygens' rows only (the model's
    sel_type), in the file's atom order: DeePMD-kit's DPLR layout."""
    oxygen = np.loadtxt(system / "type.raw", dtype=int) == 0
    for path in sorted(system.glob("set.*/atomic_*.npy")):
        values = np.load(path)
        np.save(
            path, values.reshape(len(values), len(oxygen), -1)[:, oxygen].reshape(len(values), -1)
        )


@pytest.mark.parametrize("kind", ["dipole", "polar"])
def test_selected_atoms_layout_trains_and_tests_alike(tmp_path, monkeypatch, kind):
    """The same project with atomic labels of all atoms and of the sel_type atoms only:
    the same learning curve (losses, statistics) and the same ``mdtrain test`` figures."""
    results = {}
    for layout in ("all", "selected"):
        inp = make_tensor_project(tmp_path / layout, kind, numb_steps=4)
        root = inp.parent
        if layout == "selected":
            for name in ("atomic", "valid"):
                _keep_selected_atoms(root / "data" / name)
        monkeypatch.chdir(root)
        assert main(["check", str(inp)]) == 0
        assert main(["train", str(inp), "-o", "out"]) == 0
        args = ["-m", "out/model.ckpt.pt", "-s", "data/valid", "--json", "t.json"]
        assert main(["test", *args, "-d", "detail", "-a"]) == 0
        details = sorted(root.glob("detail*"))
        results[layout] = (
            (root / "out" / "lcurve.out").read_text(),
            json.loads((root / "t.json").read_text())["total"],
            {p.name: p.read_text() for p in details},
        )
    assert results["selected"][0] == results["all"][0]
    assert results["selected"][1] == results["all"][1]
    assert results["selected"][2] == results["all"][2] and results["all"][2]
    label = "dipole" if kind == "dipole" else "polarizability"
    assert results["all"][1][f"atomic_{label}_rmse"] > 0
