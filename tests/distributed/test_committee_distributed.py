"""A committee trained by two Gloo ranks (started as torchrun starts them): member k equals a two-rank single run
with the model seeds + k (one joint step, gradients of every member averaged in one set of
overlapped buckets), and, from one model's weights, with the training seed + k. float64."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mdtrain.cli import main
from tests.helpers.training import (
    lcurve_rows,
    load_params,
    make_project,
    max_param_diff,
    train_runs_on_ranks,
)

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180
TOL = 1e-10


def variant(inp, name: str, model_seed: int = 0, training_seed: int = 0, **training):
    config = json.loads(inp.read_text())
    for section in ("descriptor", "fitting_net"):
        config["model"][section]["seed"] += model_seed
    config["training"]["seed"] += training_seed
    config["training"].update(training)
    path = inp.parent / name
    path.write_text(json.dumps(config))
    return path


def assert_same_run(a_dir, b_dir, step: int) -> None:
    np.testing.assert_allclose(
        lcurve_rows(a_dir / "lcurve.out"), lcurve_rows(b_dir / "lcurve.out"), rtol=TOL, atol=TOL
    )
    name = f"model.ckpt-{step}.pt"
    assert max_param_diff(load_params(a_dir / name), load_params(b_dir / name)) < TOL


def test_two_rank_committee_members_equal_two_rank_single_runs(tmp_path):
    inp = make_project(
        tmp_path,
        numb_steps=3,
        save_freq=3,
        training_data={"systems": ["data/train_a", "data/train_b"], "batch_size": 1},
    )
    single = variant(inp, "single_1.json", model_seed=1)
    committee_log, _ = train_runs_on_ranks(
        [(inp, tmp_path / "committee", ("--ensemble", "2"), {}),
         (single, tmp_path / "single_1", (), {})],
        timeout=TIMEOUT,
    )  # fmt: skip
    assert committee_log.count("committee of 2 models (shared sampling)") == 1, committee_log
    assert_same_run(tmp_path / "committee" / "member-1", tmp_path / "single_1", 3)


def test_two_rank_committee_from_one_model_samples_per_member(tmp_path):
    inp = make_project(
        tmp_path,
        numb_steps=1,
        save_freq=1,
        training_data={"systems": ["data/train_a", "data/train_b"], "batch_size": 1},
    )
    assert main(["train", str(inp), "-o", str(tmp_path / "base")]) == 0  # the one model
    start = str(tmp_path / "base" / "model.ckpt-1.pt")
    steps = {"numb_steps": 3, "save_freq": 3}
    committee = variant(inp, "committee.json", ensemble=2, **steps)
    single = variant(inp, "single_1.json", training_seed=1, **steps)
    train_runs_on_ranks(
        [(committee, tmp_path / "committee", ("--init-model", start), {}),
         (single, tmp_path / "single_1", ("--init-model", start), {})],
        timeout=TIMEOUT,
    )  # fmt: skip
    assert_same_run(tmp_path / "committee" / "member-1", tmp_path / "single_1", 3)
