"""Data-parallel training on CPU with Gloo: torchrun (one and two nodes), rank-equivalence in
float64, restarts across world sizes, backend fallback, rank-0 failure and injected OOM (the
equivalence tests start their ranks as torchrun does, without its agent)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from tests.helpers.processes import (
    clean_env,
    free_port,
    run_process,
    run_processes,
    torchrun_command,
)
from tests.helpers.training import (
    lcurve_rows,
    load_params,
    make_project,
    max_param_diff,
    train_on_ranks,
    train_runs_on_ranks,
)

pytestmark = pytest.mark.multiprocess
TIMEOUT = 120


def torchrun_train(inp, *extra: str, nproc: int = 2, env: dict | None = None, **kw):
    out = str(inp.parent / "out")
    cmd = torchrun_command(
        "mdtrain", ["train", str(inp), "-o", out, *extra], nproc, extra=["-m"], **kw
    )
    return run_process(cmd, TIMEOUT, clean_env(env), cwd=inp.parent)


def two_rank_train(inp, *extra: str, env: dict | None = None):
    """Two ranks as torchrun starts them, without its agent (for the tests whose subject is
    the training; torchrun itself runs the first test and the failure test)."""
    return train_on_ranks(inp, inp.parent / "out", *extra, env=env, timeout=TIMEOUT)


def single_train(inp, *extra: str) -> int:
    """One rank, in this process (no process group)."""
    return main(["train", str(inp), "-o", str(inp.parent / "out"), *extra])


BATCH_1 = {"training_data": {"systems": ["data/train_a", "data/train_b"], "batch_size": 1}}
OOM_ON_RANK1 = {"MDTRAIN_SIMULATE_OOM_ATOMS": "30", "MDTRAIN_SIMULATE_OOM_RANKS": "1"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, tuple]:
    """The two-rank runs the tests below start from, in turn on one pair of rank processes:
    ``(input, log)`` by name; the output of each is ``out/`` beside its input. "moves" is
    for the test that continues it (and changes its folder)."""
    runs = {
        "two": (make_project(tmp_path_factory.mktemp("two"), numb_steps=1, **BATCH_1), {}),
        "moves": (make_project(tmp_path_factory.mktemp("moves"), numb_steps=4, save_freq=2), {}),
        "ref": (make_project(tmp_path_factory.mktemp("ref"), numb_steps=3), {}),
        "oom": (make_project(tmp_path_factory.mktemp("oom"), numb_steps=3), OOM_ON_RANK1),
    }
    jobs = [(inp, inp.parent / "out", (), env) for inp, env in runs.values()]
    logs = train_runs_on_ranks(jobs, timeout=TIMEOUT)
    return {name: (run[0], log) for (name, run), log in zip(runs.items(), logs, strict=True)}


def test_two_ranks_train_once_and_log_once(tmp_path):
    inp = make_project(tmp_path)
    run = torchrun_train(inp).check()
    out = tmp_path / "out"
    assert lcurve_rows(out / "lcurve.out")[:, 0].tolist() == [1, 2, 4, 6]
    assert sorted(n for n in os.listdir(out) if n.startswith("model.ckpt-")) == [
        "model.ckpt-3.pt",
        "model.ckpt-6.pt",
    ]
    log = run.stderr
    assert log.count("2 rank(s), backend gloo") == 1, log
    assert log.count("neighbour statistics: min distance") == 1, log
    assert log.count("finished at step 6") == 1, log


def test_two_ranks_equal_one_rank_with_double_batch(two_ranks, tmp_path):
    """float64: one step with per-rank batch b on 2 ranks = one step with 2b on 1 rank."""
    two = two_ranks["two"][0]
    one = make_project(
        tmp_path / "one",
        numb_steps=1,
        training_data={"systems": ["data/train_a", "data/train_b"], "batch_size": 2},
    )
    assert single_train(one) == 0
    a = load_params(two.parent / "out" / "model.ckpt-1.pt")
    b = load_params(one.parent / "out" / "model.ckpt-1.pt")
    assert max_param_diff(a, b) < 1e-10
    # the step moved the parameters, so the comparison is not vacuous: a different batch differs
    other = make_project(tmp_path / "other", numb_steps=1, **BATCH_1)
    assert single_train(other) == 0
    assert max_param_diff(a, load_params(other.parent / "out" / "model.ckpt-1.pt")) > 1e-8


def test_checkpoints_move_between_world_sizes(two_ranks):
    inp = two_ranks["moves"][0]  # 4 steps on two ranks, saved every 2
    out = inp.parent / "out"
    os.remove(out / "model.ckpt-4.pt")
    assert single_train(inp, "--restart", str(out / "model.ckpt-2.pt")) == 0
    assert lcurve_rows(out / "lcurve.out")[:, 0].tolist() == [1, 2, 4]
    config = json.loads(inp.read_text())
    config["training"]["numb_steps"] = 6
    inp.write_text(json.dumps(config))
    two_rank_train(inp, "--restart", "auto").check()
    assert lcurve_rows(out / "lcurve.out")[:, 0].tolist() == [1, 2, 4, 6]


def test_two_agents_multi_node_on_loopback(tmp_path):
    inp = make_project(tmp_path, numb_steps=2)
    port = free_port()
    out = str(tmp_path / "out")
    commands = [
        torchrun_command(
            "mdtrain",
            ["train", str(inp), "-o", out],
            1,
            nnodes=2,
            node_rank=r,
            master_port=port,
            extra=["-m"],
        )
        for r in (0, 1)
    ]
    runs = run_processes(commands, TIMEOUT, [clean_env(), clean_env()], cwd=tmp_path)
    for run in runs:
        run.check()
    assert "2 rank(s), backend gloo" in runs[0].stderr
    assert lcurve_rows(tmp_path / "out" / "lcurve.out")[:, 0].tolist() == [1, 2]


def test_backend_fallback_and_strict_refusal(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=1)
    capsys.readouterr()
    assert single_train(inp, "--backend", "nccl") == 0
    err = capsys.readouterr().err
    assert err.count("WARNING") >= 1 and "gloo" in err
    config = json.loads(inp.read_text())
    config["training"]["distributed"] = {"backend": "nccl", "fallback": False}
    inp.write_text(json.dumps(config))
    assert single_train(inp) == 1
    err = capsys.readouterr().err
    assert "nccl" in err.lower() and "Traceback" not in err


def test_rank0_failure_reaches_every_rank(tmp_path):
    """Neighbour statistics run on rank 0 only; their error must end rank 1 too, not hang it."""
    inp = make_project(tmp_path, numb_steps=1)
    coord_file = tmp_path / "data" / "train_b" / "set.000" / "coord.npy"
    coord = np.load(coord_file)
    coord[2, 3:6] = coord[2, 0:3]  # two atoms on top of each other in frame 2
    np.save(coord_file, coord)
    run = torchrun_train(inp)
    assert run.returncode not in (0, None) and not run.timed_out
    assert run.stderr.count("overlap") >= 2, run.stderr  # rank 0 and rank 1 both report it
    assert "[rank 1]" in run.stderr


def test_injected_oom_on_rank1_changes_nothing(two_ranks):
    """Only rank 1 runs out of memory: both ranks retry with micro-batches, same parameters."""
    (ref, ref_log), (oom, oom_log) = two_ranks["ref"], two_ranks["oom"]
    assert "out of memory" in oom_log and "out of memory" not in ref_log
    a = load_params(ref.parent / "out" / "model.ckpt-3.pt")
    b = load_params(oom.parent / "out" / "model.ckpt-3.pt")
    assert max_param_diff(a, b) < 1e-8
    # rank 0 writes the checkpoint, with rank 1's splits (rank 0 itself never split a size)
    state = torch.load(oom.parent / "out" / "model.ckpt-3.pt", weights_only=True)
    sizes = state["controller_state"]["sizes"]
    assert sizes and all(e["nsplit"] == 2 for e in sizes), sizes
