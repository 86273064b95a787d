"""Dipole and polar models on 2 Gloo ranks (float64): one step with per-rank batch b on 2 ranks
equals one step with 2b on 1 rank, and an out-of-memory error on rank 1 alone (injected) makes
both ranks retry the step split, with the same parameters as a run without it."""

from __future__ import annotations

import json

import pytest

from mdtrain.cli import main
from tests.helpers.training import (
    load_params,
    make_tensor_project,
    max_param_diff,
    train_runs_on_ranks,
)

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180


def project(root, kind: str, batch_size: int, numb_steps: int = 1):
    inp = make_tensor_project(root, kind, numb_steps=numb_steps)
    config = json.loads(inp.read_text())
    config["training"].update(save_freq=numb_steps, disp_freq=numb_steps)
    config["training"]["training_data"]["batch_size"] = batch_size
    inp.write_text(json.dumps(config))
    return inp


def train(inp) -> None:
    """One rank, in this process (the command's ``main``; no process group)."""
    assert main(["train", str(inp), "-o", str(inp.parent / "out")]) == 0


def train_two_ranks(*runs: tuple) -> list[str]:
    """``(input, env)`` runs, in turn on the same two Gloo ranks (as torchrun starts them;
    the launcher is not the subject here): their logs."""
    jobs = [(inp, inp.parent / "out", (), env) for inp, env in runs]
    return train_runs_on_ranks(jobs, timeout=TIMEOUT)


def params(inp, step: int):
    return load_params(inp.parent / "out" / f"model.ckpt-{step}.pt")


KINDS = ("dipole", "polar")
# 2 frames of 18 atoms per rank: rank 1 fails every batch of more than 30 atoms
OOM_ON_RANK1 = {"MDTRAIN_SIMULATE_OOM_ATOMS": "30", "MDTRAIN_SIMULATE_OOM_RANKS": "1"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[tuple[str, str], tuple]:
    """Per kind, on two ranks: one step with batch 1 per rank ("two"), three steps with batch
    2 per rank without ("ref") and with ("oom") an out-of-memory error on rank 1; every run in
    turn on one pair of rank processes. ``(input, log)`` of each."""
    root = tmp_path_factory.mktemp("two_ranks")
    runs = {}
    for kind in KINDS:
        runs[kind, "two"] = (project(root / kind / "two", kind, batch_size=1), {})
        runs[kind, "ref"] = (project(root / kind / "ref", kind, batch_size=2, numb_steps=3), {})
        oom = project(root / kind / "oom", kind, batch_size=2, numb_steps=3)
        runs[kind, "oom"] = (oom, OOM_ON_RANK1)
    logs = train_two_ranks(*runs.values())
    return {key: (run[0], log) for (key, run), log in zip(runs.items(), logs, strict=True)}


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_equal_one_rank_with_double_batch(two_ranks, tmp_path, kind):
    two = two_ranks[kind, "two"][0]
    one = project(tmp_path / "one", kind, batch_size=2)
    other = project(tmp_path / "other", kind, batch_size=1)
    train(one)
    train(other)
    a, b = params(two, 1), params(one, 1)
    assert max_param_diff(a, b) < 1e-10
    assert max_param_diff(a, params(other, 1)) > 1e-8  # another batch moves them elsewhere


@pytest.mark.parametrize("kind", KINDS)
def test_injected_oom_on_rank1_changes_nothing(two_ranks, kind):
    (ref, _), (oom, oom_log) = two_ranks[kind, "ref"], two_ranks[kind, "oom"]
    assert "out of memory" in oom_log
    assert max_param_diff(params(ref, 3), params(oom, 3)) < 1e-10
