"""A run with ``training.enable_ema`` stands for its averaged weights: ``freeze``, ``test``,
``change-bias`` and ``--init-model`` of its regular checkpoints take the average
(``--live-weights`` the live ones), ``--restart`` continues the live weights and the average,
and DeePMD-kit's ``model_ema.ckpt-*`` files are still written."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from mdtrain.model.files import STANDS_FOR, load_checkpoint, model_weights
from tests.helpers.training import make_project


def train(inp, out, *extra: str) -> int:
    return main(["train", str(inp), "-o", str(out), *extra])


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_json(tmp_path, model, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    argv = ["test", "-m", str(model), "-s", str(tmp_path / "data" / "valid"), "--json", str(out)]
    assert main([*argv, *extra]) == 0
    return json.loads(out.read_text())


test_json.__test__ = False  # a helper, not a test


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """6 steps with a slow average (decay 0.5: it differs from the live weights) and full
    validation ranking the live weights."""
    root = tmp_path_factory.mktemp("ema")
    inp = make_project(root, enable_ema=True, ema_decay=0.5)
    config = json.loads(inp.read_text())
    config["validating"] = {"full_validation": True, "validation_freq": 3, "full_val_start": 0}
    inp.write_text(json.dumps(config))
    assert train(inp, root / "out") == 0
    return root


def test_checkpoint_stands_for_its_average(ema_run):
    out = ema_run / "out"
    regular = load_checkpoint(out / "model.ckpt-6.pt")
    averaged = load_checkpoint(out / "model_ema.ckpt-6.pt")  # DeePMD-kit's file, still written
    # the regular checkpoint keeps the live weights and the average, for --restart
    live = regular["model_state"]
    assert "optimizer_state" in regular and regular["ema"]["model"]
    used = model_weights(regular)
    assert used["averaged_weights"] is True and "optimizer_state" not in used
    for key, tensor in averaged["model_state"].items():
        assert torch.equal(used["model_state"][key], tensor), key
    differ = [
        k for k in regular["ema"]["model"] if not torch.equal(live[k], used["model_state"][k])
    ]
    assert differ  # the average is not the live weights
    assert torch.equal(used["model_state"]["out_bias"], live["out_bias"])  # buffers shared
    assert model_weights(regular, live=True) is regular
    assert model_weights(averaged) is averaged  # nothing to swap

    model = load_model(out / "model.ckpt.pt")
    assert all(torch.equal(p, averaged["model_state"][n]) for n, p in params(model).items())
    model = load_model(out / "model.ckpt.pt", live=True)
    assert all(torch.equal(p, live[n]) for n, p in params(model).items())


def test_a_mismatched_average_is_one_line(ema_run):
    state = load_checkpoint(ema_run / "out" / "model.ckpt-6.pt")
    name = next(iter(state["ema"]["model"]))
    state["ema"]["model"][name] = torch.zeros(2, 3, 5, dtype=torch.float64)
    with pytest.raises(MDTrainError, match="model.ckpt-6.pt: its weight average"):
        model_weights(state, source="checkpoint model.ckpt-6.pt")


def test_freeze_and_test_take_the_average(ema_run, tmp_path):
    out = ema_run / "out"
    (tmp_path / "data").symlink_to(ema_run / "data")
    default = tmp_path / "default.dp"
    raw = tmp_path / "raw.dp"
    assert main(["freeze", str(out), "-o", str(default)]) == 0  # a folder: model.ckpt.pt
    assert main(["freeze", str(out / "model.ckpt.pt"), "-o", str(raw), "--live-weights"]) == 0
    ema_file = test_json(tmp_path, out / "model_ema.ckpt.pt", "ema_file")
    checkpoint = test_json(tmp_path, out / "model.ckpt.pt", "checkpoint")
    frozen = test_json(tmp_path, default, "frozen")
    live = test_json(tmp_path, out / "model.ckpt.pt", "live", "--live-weights")
    frozen_live = test_json(tmp_path, raw, "frozen_live")
    for a, b in ((checkpoint, ema_file), (frozen, ema_file), (frozen_live, live)):
        assert a["total"] == pytest.approx(b["total"], rel=1e-10, abs=1e-12)
    assert live["total"] != pytest.approx(ema_file["total"], rel=1e-6)


def test_best_checkpoints_of_the_live_weights_stand_for_them(ema_run):
    out = ema_run / "out"
    best = sorted(out.glob("best.ckpt-*.t-1.pt"))
    assert len(best) == 1
    state = load_checkpoint(best[0])
    assert state[STANDS_FOR] == "live" and state["ema"]["model"]  # ranked by the live weights
    model = load_model(best[0])
    assert all(torch.equal(p, state["model_state"][n]) for n, p in params(model).items())


def mean_energy_error(model: torch.nn.Module, path) -> float:
    from mdtrain.data import open_system
    from mdtrain.infer.test import evaluate_system

    system = open_system(str(path), ["O", "H"])
    res = evaluate_system(model, system, system.nframes)
    return float(np.mean(res.pred["energy"] - res.label["energy"]))


def test_change_bias_keeps_the_live_weights_and_average(ema_run, tmp_path):
    out = ema_run / "out"
    source = out / "model.ckpt-6.pt"
    target = tmp_path / "changed.pt"
    valid = ema_run / "data" / "valid"
    assert main(["change-bias", str(source), "-s", str(valid), "-o", str(target)]) == 0
    before, after = load_checkpoint(source), load_checkpoint(target)
    for key, tensor in before["ema"]["model"].items():  # the parameters: live and average
        assert torch.equal(after["model_state"][key], before["model_state"][key]), key
        assert torch.equal(after["ema"]["model"][key], tensor), key
    assert not torch.equal(after["model_state"]["out_bias"], before["model_state"]["out_bias"])
    # refitted to the averaged model's errors (one composition: their mean becomes zero)
    scale = abs(mean_energy_error(load_model(source), valid))
    assert abs(mean_energy_error(load_model(target), valid)) < 1e-9 * max(scale, 1.0)
    assert abs(mean_energy_error(load_model(target, live=True), valid)) > 1e-6


def test_init_model_starts_from_the_average(ema_run, tmp_path):
    out = ema_run / "out"
    config = json.loads((ema_run / "input.json").read_text())
    # one step at learning rate 0 (the warm-up's first), saved: the weights the run started from
    config["training"].update(numb_steps=2, save_freq=1, enable_ema=False)
    config["learning_rate"]["warmup_steps"] = 1
    config.pop("validating")
    (tmp_path / "data").symlink_to(ema_run / "data")
    inp = tmp_path / "input.json"
    inp.write_text(json.dumps(config))
    assert train(inp, tmp_path / "init", "--init-model", str(out / "model.ckpt-6.pt")) == 0
    started = load_checkpoint(tmp_path / "init" / "model.ckpt-1.pt")["model_state"]
    averaged = load_checkpoint(out / "model_ema.ckpt-6.pt")["model_state"]
    names = load_checkpoint(out / "model.ckpt-6.pt")["ema"]["model"]
    assert all(torch.equal(started[k], averaged[k]) for k in names)


def test_a_short_average_is_warned_before_the_first_step(caplog):
    """0.999 ** 2000 leaves 13.5 % of the starting weights in the average that freeze and test
    deploy: warned; 10,000 steps leave 0.005 %: not; no EMA: never."""
    from mdtrain.train.ema import warn_short_average

    with caplog.at_level(logging.WARNING, logger="mdtrain"):
        warn_short_average({"enable_ema": True}, 2000)
    assert "13.5 % of the starting weights" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mdtrain"):
        warn_short_average({"enable_ema": True}, 10_000)
        warn_short_average({"enable_ema": False}, 10)
        warn_short_average({"enable_ema": True, "ema_decay": 0.5}, 10)
    assert caplog.text == ""
