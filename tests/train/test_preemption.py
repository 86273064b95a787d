"""Preemption: SIGTERM or SIGUSR1 mid-training makes every rank finish the same step, write a
checkpoint of it and exit 0 without the `finished` marker; `--restart auto` then ends exactly
where an uninterrupted run ends (float64, same ranks): equal parameters, equal lcurve rows."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import clean_env, run_process
from tests.helpers.runs import (
    DEADLINE,
    NUMB_STEPS,
    Cleanup,
    assert_same_run,
    checkpoint_index,
    finished_reference,
    has_row_after,
    launch,
    logged_steps,
    long_project,
    stop_steps,
    train_command,
    wait_until,
)

pytestmark = pytest.mark.multiprocess


def test_sigterm_stops_single_process_then_restart_auto_resumes_exactly(
    reference_run, tmp_path, cleanup
):
    reference = reference_run(1)
    inp = long_project(tmp_path)
    out = tmp_path / "out"
    step = preempt_single_process(inp, signal.SIGTERM, cleanup)
    config = json.loads(inp.read_text())
    config["training"]["restart"] = "auto"  # the input's form of --restart auto
    inp.write_text(json.dumps(config))
    resumed = run_process(train_command(inp), DEADLINE, clean_env()).check()
    assert f"continuing from {out / f'model.ckpt-{step}.pt'} at step {step}" in resumed.stderr
    assert_same_run(out, finished_reference(reference))


def test_sigusr1_stops_single_process_at_a_checkpointed_step(tmp_path, cleanup):
    preempt_single_process(long_project(tmp_path), signal.SIGUSR1, cleanup)


def preempt_single_process(inp: Path, signum: int, cleanup: Cleanup) -> int:
    """Signal a run after its first step; check it stopped cleanly; return the step."""
    out = inp.parent / "out"
    run = cleanup(launch(train_command(inp), inp.parent))
    wait_until(has_row_after(out / "lcurve.out", 1), run, what="lcurve row after step 1")
    os.kill(run.proc.pid, signum)
    code, log = run.finish()
    assert code == 0, log
    (step,) = stop_steps(log)
    assert 1 < step < NUMB_STEPS, log
    assert f"{signal.Signals(signum).name} received" in log
    assert f"preempted at step {step} of {NUMB_STEPS}" in log
    assert checkpoint_index(out) == f"model.ckpt-{step}.pt"
    assert torch.load(out / f"model.ckpt-{step}.pt", weights_only=True)["step"] == step
    assert logged_steps(out / "lcurve.out")[-1] == step
    assert not (out / "finished").exists()
    return step


def test_sigterm_to_torchrun_stops_both_ranks_at_one_step_then_resumes_exactly(
    reference_run, tmp_path, cleanup
):
    """torchrun forwards SIGTERM to its workers; they vote, stop after the same step, rank 0
    writes that step's checkpoint; a 2-rank `--restart auto` equals an uninterrupted run."""
    reference = reference_run(2)
    inp = long_project(tmp_path)
    out = inp.parent / "out"
    run = cleanup(launch(train_command(inp, nproc=2), inp.parent))
    wait_until(has_row_after(out / "lcurve.out", 1), run, what="lcurve row after step 1")
    os.kill(run.proc.pid, signal.SIGTERM)  # the agent only
    _, log = run.finish()  # torchrun itself exits non-zero after a signal; the workers with 0
    steps = stop_steps(log)
    assert len(steps) == 2 and steps[0] == steps[1], log  # rank 0 and rank 1 agree
    step = steps[0]
    assert 1 < step < NUMB_STEPS, log
    assert log.count("SIGTERM received") == 2, log
    assert f"preempted at step {step} of {NUMB_STEPS}" in log
    assert "exitcode" not in log or "exitcode  : 0" in log, log  # no worker failed
    assert checkpoint_index(out) == f"model.ckpt-{step}.pt"
    assert not (out / "finished").exists()

    resumed = launch(train_command(inp, "--restart", "auto", nproc=2), inp.parent, name="resume")
    code, resumed_log = cleanup(resumed).finish()
    assert code == 0, resumed_log
    assert f"continuing from {out / f'model.ckpt-{step}.pt'} at step {step}" in resumed_log
    assert_same_run(out, finished_reference(reference))
