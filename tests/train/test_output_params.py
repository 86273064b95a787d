"""DOS and property models with frame and atomic parameters (``numb_fparam``, ``numb_aparam``,
as DeePMD-kit's DOS and property fittings take them): ``mdtrain check`` and ``train`` (the
parameters' statistics installed), ``freeze`` to ``.dp`` and ``.pth`` (both give the
checkpoint's outputs, which depend on the parameters; ``.pt2``:
tests/infer/test_export_registry.py), ``mdtrain test`` on both (figures
recomputed here from those outputs) and the ASE calculator (parameters from ``atoms.info``
and ``atoms.arrays``)."""

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
from mdtrain.data.params import ParamSpec
from mdtrain.errors import MDTrainError
from mdtrain.infer.calculator import MDTrainCalculator
from mdtrain.infer.load import load_model
from mdtrain.neighbors.layout import layout_of
from tests.helpers.output_data import make_output_project


def _outputs(model, system, fparam_shift: float = 0.0) -> dict[str, np.ndarray]:
    """The model's outputs on all frames of ``system`` (its frame parameters shifted)."""
    batch = make_batch(
        system, np.arange(system.nframes), float(model.rcut), [int(s) for s in model.sel],
        torch.device("cpu"), layout=layout_of(model), params=ParamSpec.of_model(model),
    )  # fmt: skip
    inputs = list(batch.inputs())
    inputs[5] = inputs[5] + fparam_shift
    out = model(*inputs)
    return {k: v.detach().numpy() for k, v in out.items()}


@pytest.mark.parametrize("kind", ["dos", "property"])
def test_parameters_train_freeze_test_and_calculate(tmp_path, monkeypatch, kind):
    inp = make_output_project(tmp_path, kind, numb_steps=6, numb_fparam=2, numb_aparam=1)
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(inp)]) == 0
    assert main(["train", str(inp), "-o", "out"]) == 0
    trained = load_model(tmp_path / "out" / "model.ckpt.pt")
    assert float(trained.fitting.fparam_avg.abs().min()) > 0.5  # the data's, about 1
    assert float(trained.fitting.aparam_avg[0]) < -0.5  # about -1
    for suffix in ("dp", "pth"):
        assert main(["freeze", "-c", "out/model.ckpt.pt", "-o", f"m.{suffix}"]) == 0
    cfg = trained.get_model_config()
    system = open_system(str(tmp_path / "data" / "valid"), ["O", "H"], output_labels(cfg))
    name = trained.output
    ref = _outputs(trained, system)
    moved = _outputs(trained, system, fparam_shift=0.5)
    assert np.abs(moved[name] - ref[name]).max() > 1e-6  # the parameters count
    frames = system.frames(range(system.nframes))
    for suffix in ("dp", "pth"):
        frozen = load_model(tmp_path / f"m.{suffix}")
        got = _outputs(frozen, system)
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-12)
        np.testing.assert_allclose(got[f"atom_{name}"], ref[f"atom_{name}"], rtol=0, atol=1e-12)
        args = ["test", "-m", f"m.{suffix}", "-s", "data/valid", "--json", f"{suffix}.json"]
        assert main(args) == 0
        figures = json.loads((tmp_path / f"{suffix}.json").read_text())["total"]
        key = "dos" if kind == "dos" else "property"
        diff = ref[name] - frames[name]
        assert figures[f"{key}_rmse"] == pytest.approx(np.sqrt(np.mean(diff**2)), rel=1e-10)
    calc = MDTrainCalculator(str(tmp_path / "m.dp"))
    atoms = Atoms(
        ["O" if t == 0 else "H" for t in system.atype],
        positions=frames["coord"][0].reshape(-1, 3),
        cell=frames["box"][0].reshape(3, 3),
        pbc=True,
    )
    atoms.info["fparam"] = frames["fparam"][0]
    atoms.arrays["aparam"] = frames["aparam"][0].reshape(-1, 1)
    np.testing.assert_allclose(calc.get_property(name, atoms), ref[name][0], atol=1e-12)
    del atoms.info["fparam"]
    with pytest.raises(MDTrainError, match=r'atoms.info\["fparam"\]'):
        MDTrainCalculator(str(tmp_path / "m.dp")).get_property(name, atoms)
