"""Dipole and polar models frozen to ``.pth`` (TorchScript) and ``.dp``: the TorchScript
module itself, the model ``mdtrain`` rebuilds from either file and ``mdtrain test`` give the
checkpoint's outputs (float64, to 1e-12; atomic RMSEs over the atoms of ``sel_type``, as
``dp test -a``); the ASE calculator reads the ``.pth`` (``.pt2``:
tests/infer/test_export_registry.py). (Scripting once failed: ``from __future__ import
annotations`` in model/tensor.py, and a branch on the fitting's class.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ase import Atoms

from mdtrain.batching import make_batch
from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.data.labels import output_labels
from mdtrain.infer.calculator import MDTrainCalculator
from mdtrain.infer.load import load_model
from mdtrain.neighbors.layout import layout_of
from tests.helpers.models import TENSOR_DESCRIPTORS
from tests.helpers.training import make_tensor_project


def _outputs(model, system) -> dict[str, np.ndarray]:
    """``model`` on all frames of ``system``, numpy."""
    batch = make_batch(
        system, np.arange(system.nframes), float(model.rcut), [int(s) for s in model.sel],
        torch.device("cpu"), layout=layout_of(model),
    )  # fmt: skip
    out = model(*batch.inputs())
    return {k: v.detach().numpy() for k, v in out.items()}


# (fitting, descriptor of TENSOR_DESCRIPTORS): type-mixed descriptors (one fitting net for
# all types) too
CASES = [
    ("dipole", "se_e2_a"),
    ("polar", "se_e2_a"),
    ("dipole", "se_atten"),
    ("polar", "se_atten_v2"),
    ("dipole", "hybrid-mixed"),
    ("polar", "hybrid-mixed"),
]


@pytest.mark.parametrize(("kind", "descriptor"), CASES)
def test_tensor_model_freezes_to_pth_and_dp(tmp_path, monkeypatch, kind, descriptor):
    desc = TENSOR_DESCRIPTORS[descriptor]
    inp = make_tensor_project(tmp_path, kind, numb_steps=4, descriptor=desc)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "out"]) == 0
    for suffix in ("pth", "dp"):
        assert main(["freeze", "-c", "out/model.ckpt.pt", "-o", f"m.{suffix}"]) == 0
    trained = load_model(tmp_path / "out" / "model.ckpt.pt")
    label = trained.label
    system = open_system(
        str(tmp_path / "data" / "valid"), ["O", "H"], output_labels(trained.get_model_config())
    )
    ref = _outputs(trained, system)
    assert np.abs(ref[label]).max() > 1e-3  # not trivially zero
    scripted = load_model(tmp_path / "m.pth", scripted=True)
    assert isinstance(scripted, torch.jit.ScriptModule)
    for name, model in (
        ("scripted", scripted),
        ("pth", load_model(tmp_path / "m.pth")),
        ("dp", load_model(tmp_path / "m.dp")),
    ):
        got = _outputs(model, system)
        assert set(got) == {label, f"atom_{label}"}, name
        for key in got:
            np.testing.assert_allclose(got[key], ref[key], rtol=0, atol=1e-12, err_msg=name)
    figures = {}
    for name in ("out/model.ckpt.pt", "m.pth", "m.dp"):
        args = ["test", "-m", name, "-s", "data/valid", "--json", "t.json"]
        assert main(args) == 0
        figures[name] = json.loads((tmp_path / "t.json").read_text())["total"]
    frames = system.frames(range(system.nframes))
    want = np.sqrt(np.mean((ref[label] - frames[label].reshape(ref[label].shape)) ** 2))
    # atomic: over the atoms of sel_type only (oxygens here), as dp test -a
    oxygens = system.atype[np.argsort(system.atype, kind="stable")] == 0  # the model's order
    atomic = ref[f"atom_{label}"] - frames[f"atomic_{label}"].reshape(ref[f"atom_{label}"].shape)
    want_atomic = np.sqrt(np.mean(atomic[:, oxygens] ** 2))
    for name, total in figures.items():
        assert total[f"{label}_rmse"] == pytest.approx(want, rel=1e-12, abs=1e-12), name
        assert total[f"atomic_{label}_rmse"] == pytest.approx(want_atomic, rel=1e-12), name
        for key, value in figures["out/model.ckpt.pt"].items():
            if isinstance(value, float):
                assert total[key] == pytest.approx(value, rel=1e-12, abs=1e-12), (name, key)
    atoms = Atoms(
        ["O" if t == 0 else "H" for t in system.atype],
        positions=frames["coord"][0].reshape(-1, 3),
        cell=frames["box"][0].reshape(3, 3),
        pbc=True,
    )
    got = MDTrainCalculator(str(tmp_path / "m.pth")).get_property(label, atoms)
    np.testing.assert_allclose(np.ravel(got), ref[label][0], rtol=0, atol=1e-12)
