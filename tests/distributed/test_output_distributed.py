"""DOS and property models trained on 2 Gloo ranks: one step with per-rank batch 1 equals one
step with batch 2 on one rank in float64 (the output statistics are computed from the same
frames on every rank; the DOS loss is a mean over frames; the property loss's sums are scaled
by the number of ranks, so the ranks' averaged gradient is that of the global batch's sum)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.output_data import make_output_project
from tests.helpers.processes import clean_env, run_process
from tests.helpers.training import (
    lcurve_rows,
    load_params,
    max_param_diff,
    mdtrain_command,
    train_on_ranks,
)

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180


def _project(root, kind: str, batch_size: int, loss_func: str | None, lr: float | None = None):
    inp = make_output_project(root, kind)
    config = json.loads(inp.read_text())
    config["training"].update(numb_steps=1, disp_freq=1, save_freq=1)
    config["training"]["training_data"]["batch_size"] = batch_size
    if loss_func is not None:
        config["loss"]["loss_func"] = loss_func
    if lr is not None:  # a step that moves nothing
        config["learning_rate"].update(start_lr=lr, stop_lr=lr)
    inp.write_text(json.dumps(config))
    return inp


def _train(inp, nproc: int, env: dict | None = None, step: int = 1) -> dict:
    if nproc == 1:
        cmd = mdtrain_command("train", str(inp), "-o", "out")
        run_process(cmd, TIMEOUT, clean_env(None, threads=2), cwd=inp.parent).check()
    else:  # the ranks without torchrun's agent: the launcher is not the subject
        run = train_on_ranks(inp, "out", env=env, timeout=TIMEOUT).check()
        if env:
            assert "out of memory" in run.stderr
    return load_params(inp.parent / "out" / f"model.ckpt-{step}.pt")


@pytest.mark.parametrize(
    ("kind", "loss_func"),
    [("dos", None), ("property", "smooth_mae"), ("property", "mape"), ("property", "rmse")],
)
def test_two_ranks_equal_one_rank_with_double_batch(tmp_path, kind, loss_func):
    a = _train(_project(tmp_path / "two", kind, 1, loss_func), 2)
    b = _train(_project(tmp_path / "one", kind, 2, loss_func), 1)
    assert max_param_diff(a, b) < 1e-10
    start = _train(_project(tmp_path / "zero", kind, 1, loss_func, lr=1e-12), 1)
    assert max_param_diff(a, start) > 1e-6  # the step moved the parameters


def test_property_rmse_is_the_root_over_the_global_batch_when_one_rank_splits(tmp_path):
    """``rmse`` over 2 ranks of 2 frames each, rank 1 alone running out of memory (its
    batches as 2 micro-batches, rank 0's whole): the parameters after 3 steps and the loss
    column of lcurve.out (``rmse_trn``, the root of the loss when ``metric`` does not name
    ``rmse``) are those of one rank with batch 4."""
    env = {"MDTRAIN_SIMULATE_OOM_ATOMS": "30", "MDTRAIN_SIMULATE_OOM_RANKS": "1"}
    runs = {}
    for name, nproc, batch in (("two", 2, 2), ("one", 1, 4)):
        inp = _project(tmp_path / name, "property", batch, "rmse")
        config = json.loads(inp.read_text())
        config["training"].update(numb_steps=3, save_freq=3)
        config["loss"]["metric"] = ["mae"]
        inp.write_text(json.dumps(config))
        params = _train(inp, nproc, env if nproc == 2 else None, step=3)
        runs[name] = params, lcurve_rows(inp.parent / "out" / "lcurve.out")
    assert max_param_diff(runs["two"][0], runs["one"][0]) < 1e-10
    two, one = runs["two"][1], runs["one"][1]
    assert two.shape == one.shape and len(one) >= 3
    np.testing.assert_array_equal(two[:, 0], one[:, 0])  # the steps
    # step, mae_val, mae_trn, rmse_val, rmse_trn (3 digits): rank 0's metric mae_trn is its
    # own frames', the loss's root rmse_trn the global batch's
    np.testing.assert_array_equal(two[:, 4], one[:, 4])
