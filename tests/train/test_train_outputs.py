"""The trainer tells the model once which outputs its loss reads
(``ExplicitEnergyModel.train_outputs``): with no virial term a training step skips the
virial, while validation still reports it."""

from __future__ import annotations

import math

import pytest
import torch

from mdtrain.config import load_config
from mdtrain.distributed import Runtime
from mdtrain.model.accel.explicit import ExplicitEnergyModel
from mdtrain.model.backend import build_model
from mdtrain.train.loop import Trainer, seed_everything
from mdtrain.train.prepare import open_datasets
from tests.helpers.training import make_project


@pytest.mark.parametrize("pref_v", [0.0, 0.02])
def test_trainer_says_whether_a_step_needs_the_virial(tmp_path, pref_v):
    inp = make_project(tmp_path)
    config = load_config(str(inp))
    config["loss"]["start_pref_v"] = pref_v
    config["model"]["descriptor"]["sel"] = [16, 32]
    data = open_datasets(config, str(inp))
    seed_everything(7)
    model = build_model(config["model"], "cpu")
    if not isinstance(model, ExplicitEnergyModel):
        pytest.skip("no explicit backend here")
    runtime = Runtime(0, 1, 0, 1, torch.device("cpu"), "gloo")
    trainer = Trainer(config, model, data.train, data.valid, runtime, str(tmp_path / "out"))
    assert model.virial_in_training is (pref_v != 0.0)
    outputs = []
    model.register_forward_hook(lambda module, args, out: outputs.append(set(out)))
    metrics = trainer.train_step(1e-3)[0]
    assert ("virial" in outputs[-1]) is (pref_v != 0.0)
    assert ("rmse_v" in metrics) is (pref_v != 0.0)
    valid = trainer.validate(1e-3)[0]
    assert "virial" in outputs[-1] and math.isfinite(valid["rmse_v"])
