"""DOS and property models end to end on data the project makes itself: ``mdtrain check``,
``mdtrain train`` (the validation error falls), ``mdtrain freeze -o model.dp`` (reads back to
the checkpoint's numbers) and ``mdtrain test`` (its JSON figures are the errors recomputed
here from the model's own outputs); and the one-line errors of bad label files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.data.labels import output_labels
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from tests.helpers.models import evaluate
from tests.helpers.output_data import make_output_project
from tests.helpers.training import lcurve_rows


@pytest.mark.parametrize("kind", ["dos", "property"])
def test_train_freeze_and_test(tmp_path, monkeypatch, kind):
    inp = make_output_project(tmp_path, kind, numb_steps=40)
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(inp)]) == 0
    out = tmp_path / "out"
    assert main(["train", str(inp), "-o", str(out)]) == 0
    rows = lcurve_rows(out / "lcurve.out")
    assert rows[-1, 1] < rows[0, 1]  # the validation loss falls
    assert main(["freeze", "-c", str(out / "model.ckpt.pt"), "-o", str(tmp_path / "m.dp")]) == 0
    frozen, trained = load_model(tmp_path / "m.dp"), load_model(out / "model.ckpt.pt")
    name = frozen.output
    system = open_system(
        str(tmp_path / "data" / "valid"), ["O", "H"], output_labels(frozen.get_model_config())
    )
    frames = system.frames(range(system.nframes))
    ours = [evaluate(frozen, c, b, system.atype) for c, b in zip(frames["coord"], frames["box"])]
    ref = [evaluate(trained, c, b, system.atype) for c, b in zip(frames["coord"], frames["box"])]
    atomic = np.stack([o[f"atom_{name}"] for o in ours])
    assert np.array_equal(atomic, np.stack([o[f"atom_{name}"] for o in ref]))
    assert main(["test", "-m", str(tmp_path / "m.dp"), "-s", "data/valid", "--json", "t.json"]) == 0
    figures = json.loads((tmp_path / "t.json").read_text())["total"]
    total = np.stack([o[name] for o in ours])
    key = "dos" if kind == "dos" else "property"
    diff = total - frames[name]
    assert figures[f"{key}_rmse"] == pytest.approx(np.sqrt(np.mean(diff**2)), rel=1e-12)
    assert figures[f"{key}_mae"] == pytest.approx(np.mean(np.abs(diff)), rel=1e-12)
    adiff = atomic - frames[f"atom_{name}"]
    assert figures[f"atom_{key}_rmse"] == pytest.approx(np.sqrt(np.mean(adiff**2)), rel=1e-12)
    if kind == "dos":  # DeePMD-kit's DOS RMSE/Natoms
        want = np.sqrt(np.mean(diff**2)) / system.natoms
        assert figures["dos_rmse_per_atom"] == pytest.approx(want, rel=1e-12)


def test_bad_label_files_are_one_line(tmp_path, capfd):
    inp = make_output_project(tmp_path, "dos", numb_steps=2, numb_dos=8)
    cfg = json.loads(inp.read_text())
    dos = tmp_path / "data" / "global" / "set.000" / "dos.npy"
    np.save(dos, np.zeros((6, 9)))
    with pytest.raises(MDTrainError, match=r"global/set.000/dos.npy: shape \[6, 9\] does not "
                       r"match \[nframes, 8\] \(the model's dos: 8 per frame\)"):  # fmt: skip
        open_system(str(dos.parents[1]), ["O", "H"], output_labels(cfg["model"]))
    dos.unlink()  # no DOS label at all: check names the system
    assert main(["check", str(inp)]) == 1
    assert "data/global: neither dos.npy nor atom_dos.npy" in capfd.readouterr().out

    prop = make_output_project(tmp_path / "p", "property", numb_steps=2)
    (tmp_path / "p" / "data" / "atomic" / "set.000" / "band_prop.npy").unlink()
    assert main(["train", str(prop), "-o", str(tmp_path / "p" / "out")]) == 1
    err = capfd.readouterr().err
    assert "data/atomic: band_prop.npy is missing (the model's property_name" in err


def test_property_names_that_mean_something_else_are_refused():
    with pytest.raises(MDTrainError, match="property_name: 'energy' names a file"):
        output_labels({"fitting_net": {"type": "property", "property_name": "energy"}})
    with pytest.raises(MDTrainError, match="property_name: required"):
        output_labels({"fitting_net": {"type": "property"}})
