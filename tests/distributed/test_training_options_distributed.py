"""DeePMD-kit 3.2's training options on 2 Gloo ranks: numb_epoch counts batches per rank,
full validation splits the frames over the ranks and adds the sums (val.log equals a numpy
evaluation of the checkpoints), the weight average and the bias refit end equal on every
rank's checkpoint writer (rank 0) and a restart continues them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.training import (
    full_validation_reference,
    lcurve_rows,
    make_project,
    train_on_ranks,
    val_log_rows,
)

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180


def test_options_on_two_ranks(tmp_path):
    inp = make_project(tmp_path, save_freq=2, disp_freq=1)
    config = json.loads(inp.read_text())
    del config["training"]["numb_steps"]
    # 8 frames per system, batch 2 per rank, 2 ranks: 2 batches a pass on each rank, p = 1/2
    config["training"].update(numb_epoch=1.5, enable_ema=True, change_bias_after_training=True)
    config["optimizer"] = {"type": "AdaMuon"}
    config["validating"] = {
        "full_validation": True, "validation_freq": 2, "full_val_start": 0,
        "validation_metric": "F:RMSE",
    }  # fmt: skip
    inp.write_text(json.dumps(config))
    out = tmp_path / "out"
    train_on_ranks(inp, out, timeout=TIMEOUT).check()
    assert lcurve_rows(out / "lcurve.out")[-1, 0] == 6
    rows = val_log_rows(out / "val.log")
    assert sorted(rows) == [2, 4, 6]
    for step in (2, 4):  # step 6's checkpoint was written again after the bias refit
        ref = full_validation_reference(out / f"model.ckpt-{step}.pt", tmp_path / "data" / "valid")
        for key, value in ref.items():
            assert rows[step][key] == pytest.approx(value, rel=2e-4), (step, key)
    live = torch.load(out / "model.ckpt-6.pt", weights_only=True)
    averaged = torch.load(out / "model_ema.ckpt-6.pt", weights_only=True)
    assert torch.equal(live["model_state"]["out_bias"], averaged["model_state"]["out_bias"])
    assert not torch.equal(
        live["model_state"]["fitting.networks.0.layers.0.weight"],
        averaged["model_state"]["fitting.networks.0.layers.0.weight"],
    )
