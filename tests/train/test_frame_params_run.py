"""Training, checking and testing with frame and atomic parameters (fparam.npy, aparam.npy)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.data.params import ParamSpec, check_params
from mdtrain.errors import MDTrainError
from tests.helpers.frame_params import make_param_project
from tests.helpers.training import lcurve_rows


def test_frames_read_in_model_atom_order(tmp_path):
    inp = make_param_project(tmp_path)
    path = str(tmp_path / "data" / "train_a")
    system = open_system(path, ["O", "H"])
    frames = system.frames([1, 3])
    raw = np.load(os.path.join(path, "set.000", "aparam.npy"))[[1, 3]]
    np.testing.assert_array_equal(frames["aparam"][:, :, 0], raw[:, system.atom_order])
    np.testing.assert_array_equal(
        frames["fparam"], np.load(os.path.join(path, "set.000", "fparam.npy"))[[1, 3]]
    )
    check_params(system, ParamSpec.of(json.loads(inp.read_text())["model"]))
    with pytest.raises(MDTrainError, match=r"fparam.npy has 2 values per frame .* numb_fparam = 3"):
        check_params(system, ParamSpec(3, 1))


def test_training_test_and_errors(tmp_path, capsys):
    inp = make_param_project(tmp_path)
    out = tmp_path / "out"
    assert main(["train", str(inp), "-o", str(out)]) == 0
    rows = lcurve_rows(out / "lcurve.out")
    assert np.isfinite(rows[:, 1:]).all()
    state = torch.load(out / "model.ckpt-6.pt", weights_only=True)["model_state"]
    avg = state["fitting.fparam_avg"].numpy()
    fp = np.concatenate(
        [np.load(tmp_path / "data" / s / "set.000" / "fparam.npy") for s in ("train_a", "train_b")]
    )
    # data_stat_nbatch 2 x ceil(32 / natoms) = 2 x 2 frames per system, the first ones
    sampled = np.concatenate(
        [
            np.load(tmp_path / "data" / s / "set.000" / "fparam.npy")[:4]
            for s in ("train_a", "train_b")
        ]
    )
    np.testing.assert_allclose(avg, sampled.mean(0), rtol=1e-12)
    assert not np.allclose(avg, fp.mean(0))  # only the sampled frames count
    assert (
        main(["test", "-m", str(out / "model.ckpt.pt"), "-s", str(tmp_path / "data" / "valid")])
        == 0
    )
    assert "virial/atom" in capsys.readouterr().out
    # a system without fparam.npy: one line naming it and the file, before any step
    os.remove(tmp_path / "data" / "train_b" / "set.000" / "fparam.npy")
    assert main(["check", str(inp)]) == 1
    err = capsys.readouterr()
    assert "train_b: fparam.npy is missing (the model has numb_fparam = 2)" in err.out + err.err
    assert main(["train", str(inp), "-o", str(tmp_path / "out2")]) == 1
    err = capsys.readouterr()
    assert "train_b: fparam.npy is missing" in err.out + err.err


def test_parameter_files_in_deepmd_kits_other_shapes(tmp_path, capsys):
    """DeePMD-kit reshapes parameter files to (nframes, -1): its fparam example stores
    aparam.npy as (1, nframes*natoms) and fparam.npy as (nframes,); both read the same here."""
    inp = make_param_project(tmp_path)
    path = tmp_path / "data" / "valid"
    before = open_system(str(path), ["O", "H"]).frames([0, 2, 3])
    for name in ("fparam", "aparam"):
        file = path / "set.000" / f"{name}.npy"
        np.save(file, np.load(file).reshape(1, -1))
    after = open_system(str(path), ["O", "H"]).frames([0, 2, 3])
    for name in ("fparam", "aparam"):
        np.testing.assert_array_equal(after[name], before[name])
    assert main(["check", str(inp)]) == 0
    np.save(path / "set.000" / "aparam.npy", np.zeros((1, 7)))
    assert main(["check", str(inp)]) == 1
    err = capsys.readouterr()
    assert "aparam.npy: shape [1, 7] does not match [nframes, 18 atoms x numb_aparam]" in err.out


def test_bias_refit_after_training_takes_the_parameters(tmp_path):
    inp = make_param_project(tmp_path, numb_steps=2, change_bias_after_training=True)
    assert main(["train", str(inp), "-o", str(tmp_path / "out")]) == 0
    state = torch.load(tmp_path / "out" / "model.ckpt.pt", weights_only=True)
    assert torch.isfinite(state["model_state"]["out_bias"]).all()
