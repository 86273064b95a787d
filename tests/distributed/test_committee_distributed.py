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


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[dict, str]:
    """The runs of both tests below, in turn on one pair of rank processes: a committee of 2
    and the single run of member 1's model seed, 3 steps; a committee of 2 and the single
    run of member 1's training seed, each from one model's weights (trained here, 1 step,
    one rank). The folders of both projects, and the first committee's log."""
    steps = {"numb_steps": 3, "save_freq": 3}
    batch = {"training_data": {"systems": ["data/train_a", "data/train_b"], "batch_size": 1}}
    seeds = make_project(tmp_path_factory.mktemp("seeds"), **steps, **batch)
    single_seed = variant(seeds, "single_1.json", model_seed=1)
    base = make_project(tmp_path_factory.mktemp("base"), numb_steps=1, save_freq=1, **batch)
    assert main(["train", str(base), "-o", str(base.parent / "base")]) == 0  # the one model
    start = ("--init-model", str(base.parent / "base" / "model.ckpt-1.pt"))
    committee = variant(base, "committee.json", ensemble=2, **steps)
    single_start = variant(base, "single_1.json", training_seed=1, **steps)
    logs = train_runs_on_ranks(
        [(seeds, seeds.parent / "committee", ("--ensemble", "2"), {}),
         (single_seed, seeds.parent / "single_1", (), {}),
         (committee, base.parent / "committee", start, {}),
         (single_start, base.parent / "single_1", start, {})],
        timeout=TIMEOUT,
    )  # fmt: skip
    return {"seeds": seeds.parent, "start": base.parent}, logs[0]


def test_two_rank_committee_members_equal_two_rank_single_runs(trained):
    folders, committee_log = trained
    assert committee_log.count("committee of 2 models (shared sampling)") == 1, committee_log
    root = folders["seeds"]
    assert_same_run(root / "committee" / "member-1", root / "single_1", 3)


def test_two_rank_committee_from_one_model_samples_per_member(trained):
    root = trained[0]["start"]
    assert_same_run(root / "committee" / "member-1", root / "single_1", 3)
