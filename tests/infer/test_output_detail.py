"""``mdtrain test -d`` and ``--parity`` of DOS and property models: DeePMD-kit 3.2's per-frame
detail files (``.dos.out.<frame>``, ``.ados.out.<frame>``, a later system's with its index
before the frame), their values the model's outputs and the labels, atoms in each system's
file order (a system with its atoms shuffled gives the shuffled rows), and a parity plot."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.data.labels import output_labels
from mdtrain.infer.load import load_model
from tests.helpers.datagen import shuffled_copy
from tests.helpers.models import evaluate
from tests.helpers.output_data import make_output_project

SUFFIX = {"dos": ("dos", "ados"), "property": ("property", "aproperty")}


@pytest.mark.parametrize("kind", ["dos", "property"])
def test_detail_files_and_parity(tmp_path, monkeypatch, kind):
    inp = make_output_project(tmp_path, kind, numb_steps=2)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "out"]) == 0
    assert main(["freeze", "-c", "out/model.ckpt.pt", "-o", "m.dp"]) == 0
    natoms = len(np.loadtxt(tmp_path / "data" / "valid" / "type.raw"))
    order = np.random.default_rng(0).permutation(natoms)
    shuffled_copy(tmp_path / "data" / "valid", tmp_path / "data" / "shuffled", order)
    args = ["test", "-m", "m.dp", "-s", "data/valid", "data/shuffled", "-d", "detail.txt"]
    assert main([*args, "--parity", "p.png", "--json", "t.json"]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0
    model = load_model(tmp_path / "m.dp")
    name = model.output
    system = open_system(str(tmp_path / "data" / "valid"), ["O", "H"], output_labels(
        model.get_model_config()
    ))  # fmt: skip
    frames = system.frames(range(system.nframes))
    frame_suffix, atom_suffix = SUFFIX[kind]
    atype = np.loadtxt(tmp_path / "data" / "valid" / "type.raw", dtype=int)
    raw_atomic = np.load(tmp_path / "data" / "valid" / "set.000" / f"atom_{name}.npy")
    for f in range(system.nframes):
        out = evaluate(model, frames["coord"][f], frames["box"][f], system.atype)
        rows = np.loadtxt(tmp_path / f"detail.{frame_suffix}.out.{f}")
        np.testing.assert_allclose(rows[:, 0], frames[name][f], rtol=0, atol=1e-12)
        np.testing.assert_allclose(rows[:, 1], out[name], rtol=0, atol=1e-10)
        header = (tmp_path / f"detail.{frame_suffix}.out.{f}").read_text().splitlines()[0]
        assert header == f"# data/valid - {f}: data_{frame_suffix} pred_{frame_suffix}"
        atomic = np.loadtxt(tmp_path / f"detail.{atom_suffix}.out.{f}")
        np.testing.assert_allclose(atomic[:, 0], raw_atomic[f], rtol=0, atol=1e-12)  # file order
        back = np.empty(natoms, dtype=int)
        back[np.argsort(atype, kind="stable")] = np.arange(natoms)
        want = out[f"atom_{name}"].reshape(natoms, -1)[back].reshape(-1)
        np.testing.assert_allclose(atomic[:, 1], want, rtol=0, atol=1e-10)
        shuffled = np.loadtxt(tmp_path / f"detail.{atom_suffix}.out.1.{f}")  # system 1
        width = atomic.shape[0] // natoms
        expected = atomic.reshape(natoms, width, 2)[order].reshape(-1, 2)
        np.testing.assert_allclose(shuffled, expected, rtol=0, atol=1e-10)
    figures = json.loads((tmp_path / "t.json").read_text())["systems"]
    assert len(figures) == 2
