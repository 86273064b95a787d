"""``mdtrain change-bias``: the bias set (-b), refitted to the errors (-m change) or to the
labels (-m set), checked against numpy least squares over the model evaluated frame by
frame; a new file of the input's kind, the input untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.infer.load import load_model
from tests.helpers.datagen import water_labeled, write_npy_system
from tests.helpers.models import evaluate, make_model, save_tiny_checkpoint


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A checkpoint and two systems of different compositions (so the fit is determined)."""
    model = make_model(descriptor={"sel": [40, 80]})
    save_tiny_checkpoint(tmp_path / "model.pt", model)
    for name, seed, swap in (("a", 1, 0), ("b", 2, 3)):
        data = water_labeled(nframes=3, nmol=4, seed=seed)
        types = np.array(data["types"])
        types[np.flatnonzero(types == 0)[:swap]] = 1  # fewer O, more H
        data["types"] = types
        write_npy_system(tmp_path / name, **data)
    monkeypatch.chdir(tmp_path)
    return tmp_path, model


def frames(root, model, nframes=None):
    """Type counts, label and predicted energies of every frame, read from the files."""
    counts, labels, preds = [], [], []
    for name in ("a", "b"):
        types = np.loadtxt(root / name / "type.raw", dtype=int)
        coord = np.load(root / name / "set.000" / "coord.npy")[:nframes]
        box = np.load(root / name / "set.000" / "box.npy")[:nframes]
        labels += list(np.load(root / name / "set.000" / "energy.npy")[:nframes])
        for c, b in zip(coord, box):
            out = evaluate(model, c.reshape(-1, 3), b.reshape(3, 3), types)
            preds.append(float(out["energy"]))
            counts.append(np.bincount(types, minlength=2))
    return np.array(counts, float), np.array(labels), np.array(preds)


def bias_of(path) -> np.ndarray:
    return load_model(path).out_bias.numpy()


def test_change_adds_the_least_squares_fit_of_the_errors(project):
    root, model = project
    before = (root / "model.pt").read_bytes()
    assert main(["change-bias", "model.pt", "-s", "a", "b"]) == 0
    counts, labels, preds = frames(root, model)
    delta = np.linalg.lstsq(counts, labels - preds, rcond=None)[0]
    np.testing.assert_allclose(
        bias_of("model_updated.pt"), model.out_bias.numpy() + delta, rtol=1e-10
    )
    assert (root / "model.pt").read_bytes() == before
    state = torch.load(root / "model_updated.pt", weights_only=True)
    assert state["format"] == "mdtrain-checkpoint" and state["step"] == 0
    # refitting the refitted model changes nothing more
    assert main(["change-bias", "model_updated.pt", "-s", "a", "b", "-o", "again.pt"]) == 0
    np.testing.assert_allclose(bias_of("again.pt"), bias_of("model_updated.pt"), atol=1e-9)


def test_set_fits_the_labels_on_the_first_frames(project):
    root, model = project
    assert main(["change-bias", "model.pt", "-s", "a", "b", "-m", "set", "-n", "2"]) == 0
    counts, labels, _ = frames(root, model, nframes=2)
    want = np.linalg.lstsq(counts, labels, rcond=None)[0]
    np.testing.assert_allclose(bias_of("model_updated.pt"), want, rtol=1e-10)


def test_given_values_in_a_dp_file(project, capsys):
    root, model = project
    assert main(["freeze", "model.pt", "-o", "model.dp"]) == 0
    assert main(["change-bias", "model.dp", "-b", "-93.5", "-187.25"]) == 0
    assert "O: " in capsys.readouterr().out
    np.testing.assert_array_equal(bias_of("model_updated.dp"), [-93.5, -187.25])
    old, new = load_model("model.dp"), load_model("model_updated.dp")
    for (name, a), (_, b) in zip(old.named_parameters(), new.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "args, message",
    [
        (["-b", "1.0"], "-b/--bias-value: 1 values, but the model's type_map ['O', 'H'] has 2"),
        (["-b", "1", "2", "-o", "model.pt"], "-o model.pt: is the input model"),
        (["-s", "nowhere"], "nowhere"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(project, capsys, args, message):
    root, _ = project
    before = (root / "model.pt").read_bytes()
    assert main(["change-bias", "model.pt", *args]) == 1
    assert message in capsys.readouterr().err
    assert (root / "model.pt").read_bytes() == before
    assert not (root / "model_updated.pt").exists()


def test_a_frozen_model_stays_frozen(project):
    root, model = project
    assert main(["freeze", "model.pt", "-o", "frozen.pth"]) == 0
    assert main(["change-bias", "frozen.pth", "-b", "-1", "-2"]) == 0
    np.testing.assert_array_equal(bias_of("frozen_updated.pth"), [-1.0, -2.0])
    scripted = load_model(root / "frozen_updated.pth", scripted=True)
    assert isinstance(scripted, torch.jit.ScriptModule)
    np.testing.assert_array_equal(bias_of("frozen.pth"), model.out_bias.numpy())
