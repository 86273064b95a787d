"""DOS and property models trained on 2 Gloo ranks: one step with per-rank batch 1 equals one
step with batch 2 on one rank in float64 (the output statistics are computed from the same
frames on every rank; the DOS loss is a mean over frames; the property loss's sums are scaled
by the number of ranks, so the ranks' averaged gradient is that of the global batch's sum)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mdtrain.cli import main
from tests.helpers.output_data import make_output_project
from tests.helpers.training import (
    lcurve_rows,
    load_params,
    max_param_diff,
    train_runs_on_ranks,
)

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180
CASES = [("dos", None), ("property", "smooth_mae"), ("property", "mape"), ("property", "rmse")]
OOM_ON_RANK1 = {"MDTRAIN_SIMULATE_OOM_ATOMS": "30", "MDTRAIN_SIMULATE_OOM_RANKS": "1"}


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


def _rmse_project(root, batch_size: int):
    """The property with the ``rmse`` loss, 3 steps, ``metric`` naming only ``mae``."""
    inp = _project(root, "property", batch_size, "rmse")
    config = json.loads(inp.read_text())
    config["training"].update(numb_steps=3, save_freq=3)
    config["loss"]["metric"] = ["mae"]
    inp.write_text(json.dumps(config))
    return inp


def _train(inp, step: int = 1) -> dict:
    """One rank, in this process (the command's ``main``)."""
    assert main(["train", str(inp), "-o", str(inp.parent / "out")]) == 0
    return load_params(inp.parent / "out" / f"model.ckpt-{step}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """The two-rank runs of the tests below, in turn on one pair of rank processes started as
    torchrun starts them, without its agent (the launcher is not the subject): each case's
    one step with batch 1 per rank, and the ``rmse`` property's 3 steps with batch 2 per
    rank and rank 1 running out of memory ("rmse split"). Their inputs and logs."""
    root = tmp_path_factory.mktemp("two_ranks")
    runs = {case: (_project(root / "-".join(map(str, case)), case[0], 1, case[1]), {})
            for case in CASES}  # fmt: skip
    runs["rmse split"] = (_rmse_project(root / "rmse-split", 2), OOM_ON_RANK1)
    jobs = [(inp, inp.parent / "out", (), env) for inp, env in runs.values()]
    logs = train_runs_on_ranks(jobs, timeout=TIMEOUT)
    return {key: (run[0], log) for (key, run), log in zip(runs.items(), logs, strict=True)}


@pytest.mark.parametrize(("kind", "loss_func"), CASES)
def test_two_ranks_equal_one_rank_with_double_batch(two_ranks, tmp_path, kind, loss_func):
    a = load_params(two_ranks[(kind, loss_func)][0].parent / "out" / "model.ckpt-1.pt")
    b = _train(_project(tmp_path / "one", kind, 2, loss_func))
    assert max_param_diff(a, b) < 1e-10
    start = _train(_project(tmp_path / "zero", kind, 1, loss_func, lr=1e-12))
    assert max_param_diff(a, start) > 1e-6  # the step moved the parameters


def test_property_rmse_is_the_root_over_the_global_batch_when_one_rank_splits(two_ranks, tmp_path):
    """``rmse`` over 2 ranks of 2 frames each, rank 1 alone running out of memory (its
    batches as 2 micro-batches, rank 0's whole): the parameters after 3 steps and the loss
    column of lcurve.out (``rmse_trn``, the root of the loss when ``metric`` does not name
    ``rmse``) are those of one rank with batch 4."""
    split, log = two_ranks["rmse split"]
    assert "out of memory" in log
    one = _rmse_project(tmp_path / "one", 4)
    runs = {
        "two": (load_params(split.parent / "out" / "model.ckpt-3.pt"), split),
        "one": (_train(one, step=3), one),
    }
    runs = {k: (p, lcurve_rows(inp.parent / "out" / "lcurve.out")) for k, (p, inp) in runs.items()}
    assert max_param_diff(runs["two"][0], runs["one"][0]) < 1e-10
    two, one = runs["two"][1], runs["one"][1]
    assert two.shape == one.shape and len(one) >= 3
    np.testing.assert_array_equal(two[:, 0], one[:, 0])  # the steps
    # step, mae_val, mae_trn, rmse_val, rmse_trn (3 digits): rank 0's metric mae_trn is its
    # own frames', the loss's root rmse_trn the global batch's
    np.testing.assert_array_equal(two[:, 4], one[:, 4])
