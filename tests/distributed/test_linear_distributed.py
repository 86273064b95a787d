"""A ``linear_ener`` model (a network and a pair table) trained on 2 Gloo ranks: one step with
per-rank batch 1 equals one step with batch 2 on one rank in float64 (each network part's
statistics and the whole's energy bias are the same on every rank)."""

from __future__ import annotations

import json

import pytest

from mdtrain.cli import main
from tests.helpers.pair_tables import linear_input
from tests.helpers.training import load_params, max_param_diff, train_runs_on_ranks

pytestmark = pytest.mark.multiprocess
TIMEOUT = 240


def _project(root, batch_size: int, lr: float | None = None):
    inp = linear_input(root, sel=[20, 40], numb_steps=1)
    config = json.loads(inp.read_text())
    config["training"].update(disp_freq=1, save_freq=1)
    config["training"]["training_data"]["batch_size"] = batch_size
    if lr is not None:  # a step that moves nothing
        config["learning_rate"].update(start_lr=lr, stop_lr=lr)
    inp.write_text(json.dumps(config))
    return inp


def test_two_ranks_equal_one_rank_with_double_batch(tmp_path):
    two, one = _project(tmp_path / "two", 1), _project(tmp_path / "one", 2)
    # two Gloo ranks as torchrun starts them (the launcher is not the subject); one rank here
    train_runs_on_ranks([(two, two.parent / "out", (), {})], timeout=TIMEOUT)
    assert main(["train", str(one), "-o", str(one.parent / "out")]) == 0
    a = load_params(two.parent / "out" / "model.ckpt-1.pt")
    b = load_params(one.parent / "out" / "model.ckpt-1.pt")
    assert max_param_diff(a, b) < 1e-10
    start_inp = _project(tmp_path / "zero", 2, lr=1e-12)
    assert main(["train", str(start_inp), "-o", str(start_inp.parent / "out")]) == 0
    start = load_params(start_inp.parent / "out" / "model.ckpt-1.pt")
    part = [k for k in a if k.startswith("parts.0.")]
    moved = max_param_diff({k: a[k] for k in part}, {k: start[k] for k in part})
    assert moved > 1e-6  # the step moved the network part's parameters
