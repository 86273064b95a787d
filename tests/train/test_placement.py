"""A whole training run with the model on another device, checked without a GPU: the run's
device (what ``select_device`` picks for a rank) is ``OtherDevice``'s (tests/helpers/
placement.py), so statistics, batches, loss, optimiser, validation, checkpoints and restarts
must put every tensor there, and the run must equal the same run on the CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import mdtrain.distributed.runtime as runtime_module
from mdtrain.cli import main
from mdtrain.model.files import load_checkpoint
from tests.helpers.output_data import make_output_project
from tests.helpers.placement import OTHER, OtherDevice, iter_tensors
from tests.helpers.training import lcurve_rows, make_project, max_param_diff


def train(inp, out, *extra: str) -> int:
    return main(["train", str(inp), "-o", str(out), *extra])


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A tiny project, and the backend a GPU gets (fused) for the CPU run as well."""
    monkeypatch.setenv("MDTRAIN_BACKEND", "fused")
    return make_project(tmp_path, numb_steps=2, save_freq=1, disp_freq=1)


def test_training_on_another_device_equals_the_cpu(tmp_path, project, monkeypatch):
    assert train(project, tmp_path / "cpu") == 0
    with monkeypatch.context() as patch, OtherDevice():
        patch.setattr(runtime_module, "select_device", lambda env, use_cuda=None: OTHER)
        assert train(project, tmp_path / "other") == 0
    cpu, other = (load_checkpoint(tmp_path / d / "model.ckpt-2.pt") for d in ("cpu", "other"))
    # the checkpoint of a run elsewhere loads on the CPU (map_location): nothing left behind
    assert {t.device.type for t in iter_tensors(other)} == {"cpu"}
    # the same run: Adam differs only in its implementation (fused on the CPU)
    assert max_param_diff(cpu["model_state"], other["model_state"]) < 1e-12
    np.testing.assert_allclose(
        lcurve_rows(tmp_path / "other" / "lcurve.out"),
        lcurve_rows(tmp_path / "cpu" / "lcurve.out"),
        rtol=1e-9,
    )
    moments = other["optimizer_state"]["state"]
    assert moments and all(s["exp_avg"].abs().sum() > 0 for s in moments.values())


def test_restart_on_another_device_from_a_cpu_checkpoint(tmp_path, project, monkeypatch):
    """A run continued elsewhere from a checkpoint written on the CPU (and back) equals the
    run continued on the CPU."""
    assert train(project, tmp_path / "cpu") == 0
    assert train(project, tmp_path / "other") == 0
    config = json.loads(project.read_text())
    config["training"]["numb_steps"] = 3
    project.write_text(json.dumps(config))
    assert train(project, tmp_path / "cpu", "--restart", "auto") == 0
    with monkeypatch.context() as patch, OtherDevice():
        patch.setattr(runtime_module, "select_device", lambda env, use_cuda=None: OTHER)
        assert train(project, tmp_path / "other", "--restart", "auto") == 0
    cpu, other = (load_checkpoint(tmp_path / d / "model.ckpt-3.pt") for d in ("cpu", "other"))
    assert other["step"] == 3
    assert max_param_diff(cpu["model_state"], other["model_state"]) < 1e-12
    steps = lcurve_rows(tmp_path / "other" / "lcurve.out")[:, 0]
    assert steps.tolist() == [1, 2, 3]
    assert torch.isfinite(other["optimizer_state"]["state"][0]["exp_avg_sq"]).all()


def test_training_options_on_another_device(tmp_path, project, monkeypatch):
    """AdaMuon, the weight average, full validation and the bias refit put their tensors on
    the run's device and give the CPU run's results."""
    config = json.loads(project.read_text())
    config["optimizer"] = {"type": "AdaMuon"}
    config["validating"] = {"full_validation": True, "validation_freq": 1, "full_val_start": 0}
    config["training"].update(enable_ema=True, ema_decay=0.5, change_bias_after_training=True)
    project.write_text(json.dumps(config))
    assert train(project, tmp_path / "cpu") == 0
    with monkeypatch.context() as patch, OtherDevice():
        patch.setattr(runtime_module, "select_device", lambda env, use_cuda=None: OTHER)
        assert train(project, tmp_path / "other") == 0
    (best,) = (p.name for p in (tmp_path / "cpu").glob("best.ckpt-*.t-1.pt"))
    for name in ("model.ckpt-2.pt", "model_ema.ckpt-2.pt", best):
        found = [tmp_path / d / name for d in ("cpu", "other")]
        cpu, other = (load_checkpoint(p) for p in found)
        assert {t.device.type for t in iter_tensors(other)} == {"cpu"}
        assert max_param_diff(cpu["model_state"], other["model_state"]) < 1e-12, name
    logs = [
        (tmp_path / d / "val.log").read_text().replace(str(tmp_path / d), "")
        for d in ("cpu", "other")
    ]
    assert logs[0] == logs[1]


def test_property_rmse_on_another_device_equals_the_cpu(tmp_path, monkeypatch):
    """The property loss's ``rmse``: its global batch sums (a pass without gradients, then
    micro-batches) made on the run's device."""
    inp = make_output_project(tmp_path, "property", numb_steps=2)
    config = json.loads(inp.read_text())
    config["loss"]["loss_func"] = "rmse"
    config["training"].update(disp_freq=1, save_freq=2)
    config["training"]["batch_controller"] = {"micro_batches": 2}
    inp.write_text(json.dumps(config))
    assert train(inp, tmp_path / "cpu") == 0
    with monkeypatch.context() as patch, OtherDevice():
        patch.setattr(runtime_module, "select_device", lambda env, use_cuda=None: OTHER)
        assert train(inp, tmp_path / "other") == 0
    cpu, other = (load_checkpoint(tmp_path / d / "model.ckpt-2.pt") for d in ("cpu", "other"))
    assert max_param_diff(cpu["model_state"], other["model_state"]) < 1e-12
    np.testing.assert_allclose(
        lcurve_rows(tmp_path / "other" / "lcurve.out"),
        lcurve_rows(tmp_path / "cpu" / "lcurve.out"),
        rtol=1e-9,
    )
