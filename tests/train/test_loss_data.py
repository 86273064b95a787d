"""The label files of the loss options: read in the model's atom order, shapes checked,
missing files named by `mdtrain check` and by training, and a short training with them."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import mdtrain.distributed.runtime as runtime_module
from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.errors import MDTrainError
from tests.helpers.placement import OTHER, OtherDevice
from tests.helpers.training import lcurve_rows, make_project


def add_labels(system, seed: int = 0, ncoord: int = 2, names=("atom_ener", "atom_pref", "drdq")):
    """Per-atom label files (file atom order) in every set of a deepmd/npy system."""
    rng = np.random.default_rng(seed)
    natoms = len(system.joinpath("type.raw").read_text().split())
    written = {}
    for folder in sorted(system.glob("set.*")):
        nf = np.load(folder / "coord.npy").shape[0]
        width = {"atom_ener": 1, "atom_pref": 1, "atom_ener_coeff": 1, "drdq": 3 * ncoord}
        for name in names:
            values = rng.uniform(0.5, 1.5, size=(nf, natoms * width[name]))
            if name == "atom_ener":
                values = values - 95.0  # about an atom's share of a water frame's energy
            np.save(folder / f"{name}.npy", values)
            written.setdefault(name, []).append(values)
    return {k: np.concatenate(v) for k, v in written.items()}


def test_labels_are_read_in_the_model_atom_order(tmp_path):
    inp = make_project(tmp_path)
    path = tmp_path / "data" / "train_a"
    written = add_labels(path, ncoord=2)
    system = open_system(str(path), ["O", "H"])
    assert system.has("atom_pref") and system.values_per_atom("drdq") == 6
    frames = system.frames([3, 1])
    order = system.atom_order
    assert not np.array_equal(order, np.arange(system.natoms))  # the sort matters here
    np.testing.assert_array_equal(frames["atom_pref"], written["atom_pref"][[3, 1]][:, order])
    drdq = written["drdq"][[3, 1]].reshape(2, system.natoms, 6)[:, order]
    np.testing.assert_array_equal(frames["drdq"], drdq)
    assert inp.exists()


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("atom_pref", (8, 5), "atom_pref.npy: shape [8, 5] does not match [nframes, "),
        ("drdq", (8, 7), "drdq.npy: shape [8, 7] does not match"),
        ("atom_ener", (3, 18), "atom_ener.npy: 3 frames but coord.npy has 8"),
    ],
)
def test_a_wrong_shape_names_the_file(tmp_path, name, shape, message):
    make_project(tmp_path)
    path = tmp_path / "data" / "train_a"
    np.save(path / "set.000" / f"{name}.npy", np.zeros(shape))
    with pytest.raises(MDTrainError, match=re.escape(message)):
        open_system(str(path), ["O", "H"])


def write_loss(inp, **loss) -> None:
    config = json.loads(inp.read_text())
    config["loss"].update(loss)
    inp.write_text(json.dumps(config))


PF = {"start_pref_pf": 2.0, "limit_pref_pf": 1.0}


def test_check_names_a_system_without_its_label_file(tmp_path, capsys):
    inp = make_project(tmp_path)
    for name in ("train_a", "valid"):
        add_labels(tmp_path / "data" / name, ncoord=3)
    write_loss(inp, **PF, start_pref_gf=1.0, limit_pref_gf=1.0, numb_generalized_coord=2)
    assert main(["check", str(inp)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    train_b = str(tmp_path / "data" / "train_b")
    assert any(train_b in line and "atom_pref.npy" in line for line in lines), lines
    assert any(train_b in line and "drdq.npy" in line and "missing" in line for line in lines)
    assert any("train_a" in line and "drdq.npy has 9 values per atom" in line for line in lines)
    assert lines[-1] == "FAILED: 4 problems"
    write_loss(inp, use_default_pf=True, numb_generalized_coord=3, start_pref_gf=0.0)
    assert main(["check", str(inp)]) == 0, capsys.readouterr().out


def test_training_refuses_a_missing_label_file_before_the_first_step(tmp_path, capsys):
    inp = make_project(tmp_path)
    write_loss(inp, **PF)
    assert main(["train", str(inp), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "atom_pref.npy" in err and "use_default_pf" in err and "(and 2 more" in err
    assert not (tmp_path / "out" / "lcurve.out").exists()


def test_training_with_the_options_writes_deepmd_columns(tmp_path):
    inp = make_project(tmp_path, numb_steps=4)
    for name in ("train_a", "train_b", "valid"):
        add_labels(tmp_path / "data" / name, names=("atom_ener", "atom_pref", "atom_ener_coeff"))
    write_loss(
        inp, loss_func="mae", f_use_norm=True, enable_atom_ener_coeff=True, relative_f=1.0,
        start_pref_ae=1.0, limit_pref_ae=1.0, **PF,
    )  # fmt: skip
    assert main(["train", str(inp), "-o", str(tmp_path / "out")]) == 0
    lcurve = tmp_path / "out" / "lcurve.out"
    header = lcurve.read_text().splitlines()[0].split()[2:-1]
    names = ["mae_ae", "mae_e", "mae_f", "mae_pf", "mae_v", "rmse"]
    assert header == [f"{n}_{s}" for n in names for s in ("val", "trn")]
    assert np.isfinite(lcurve_rows(lcurve)[:, 1:]).all()


def test_options_on_another_device_equal_the_cpu(tmp_path, monkeypatch):
    """Every label file and term placed on the run's device (tests/train/test_placement.py)."""
    monkeypatch.setenv("MDTRAIN_BACKEND", "fused")
    inp = make_project(tmp_path, numb_steps=2, save_freq=1, disp_freq=1)
    for name in ("train_a", "train_b", "valid"):
        add_labels(
            tmp_path / "data" / name, names=("atom_ener", "atom_pref", "atom_ener_coeff", "drdq")
        )
    write_loss(
        inp, loss_func="mae", enable_atom_ener_coeff=True, start_pref_ae=1.0, limit_pref_ae=1.0,
        start_pref_gf=1.0, limit_pref_gf=1.0, numb_generalized_coord=2, **PF,
    )  # fmt: skip
    assert main(["train", str(inp), "-o", str(tmp_path / "cpu")]) == 0
    with monkeypatch.context() as patch, OtherDevice():
        patch.setattr(runtime_module, "select_device", lambda env, use_cuda=None: OTHER)
        assert main(["train", str(inp), "-o", str(tmp_path / "other")]) == 0
    rows = [lcurve_rows(tmp_path / d / "lcurve.out") for d in ("cpu", "other")]
    assert np.isfinite(rows[0]).all()
    np.testing.assert_allclose(rows[1], rows[0], rtol=1e-9)


def test_check_finds_nan_in_a_label_file(tmp_path, capsys):
    inp = make_project(tmp_path)
    for name in ("train_a", "train_b", "valid"):
        add_labels(tmp_path / "data" / name, names=("atom_pref",))
    path = tmp_path / "data" / "train_b" / "set.000" / "atom_pref.npy"
    values = np.load(path)
    values[5, 3] = np.nan
    np.save(path, values)
    write_loss(inp, **PF)
    assert main(["check", str(inp)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("train_b" in ln and "atom_pref holds NaN or inf in frame 5" in ln for ln in lines)
