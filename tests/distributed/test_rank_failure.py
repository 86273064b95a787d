"""A rank that dies or stalls: torchrun with restarts relaunches the group, which continues from
the newest checkpoint by itself and ends exactly like an uninterrupted run; without restarts the
survivors stop with one clear error line within training.distributed.timeout, never hang."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

import mdtrain
from mdtrain import distributed as dist_rt
from mdtrain.cli import main
from tests.helpers.processes import clean_env, free_port, spawn_workers, torchrun_vars
from tests.helpers.runs import (
    SAVE_FREQ,
    assert_same_run,
    checkpoint_index,
    finished_reference,
    has_row_after,
    launch,
    long_project,
    train_command,
    wait_until,
    worker_of_rank,
)
from tests.helpers.training import make_project

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 10  # training.distributed.timeout of the runs below


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in f" {line}"]


def test_killed_rank_is_relaunched_and_resumes_from_the_newest_checkpoint(
    reference_run,
    tmp_path,
    cleanup,
):
    reference = reference_run(2)
    inp = long_project(tmp_path)
    out = inp.parent / "out"
    run = cleanup(launch(train_command(inp, nproc=2, launcher=["--max-restarts=1"]), inp.parent))
    wait_until(has_row_after(out / "lcurve.out", SAVE_FREQ), run, what="a row after a save")
    newest = checkpoint_index(out)
    os.kill(worker_of_rank(run.proc.pid, 1), signal.SIGKILL)
    code, log = run.finish()
    assert code == 0, log
    assert "relaunched by torchrun (restart 1)" in log, log
    step = int(newest.removeprefix("model.ckpt-").removesuffix(".pt"))
    assert f"continuing from {out / newest} at step {step}" in log, log
    assert_same_run(out, finished_reference(reference))


def test_without_restarts_the_survivor_stops_with_one_error_line(tmp_path, cleanup):
    inp = long_project(tmp_path)
    out = inp.parent / "out"
    run = cleanup(launch(train_command(inp, nproc=2, launcher=["--max-restarts=0"]), inp.parent))
    wait_until(has_row_after(out / "lcurve.out", 2), run, what="a row after step 2")
    os.kill(worker_of_rank(run.proc.pid, 1), signal.SIGKILL)
    code, log = run.finish()
    assert code != 0, log
    errors = [line for line in error_lines(log) if "lost contact" in line]
    assert len(errors) == 1 and errors[0].startswith("ERROR rank 0: lost contact"), log
    assert f'File "{os.path.dirname(mdtrain.__file__)}' not in log, log  # no traceback of ours
    assert not (out / "finished").exists()


def test_stalled_rank_makes_the_survivor_give_up_after_the_timeout(tmp_path, cleanup):
    """Two `mdtrain train` processes launched like srun would (no agent to tear them down):
    rank 1 is stopped (SIGSTOP) mid-training; rank 0 must end by itself, with exit code 1."""
    inp = long_project(tmp_path)
    config = json.loads(inp.read_text())
    config["training"]["distributed"] = {"timeout": TIMEOUT_S}
    inp.write_text(json.dumps(config))
    out = inp.parent / "out"
    port = free_port()
    ranks = [
        cleanup(launch(train_command(inp), tmp_path, clean_env(torchrun_vars(r, 2, port)), f"r{r}"))
        for r in (0, 1)
    ]
    wait_until(has_row_after(out / "lcurve.out", 2), ranks[0], what="a row after step 2")
    os.kill(ranks[1].proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    code, log = ranks[0].finish(timeout=TIMEOUT_S + 120)
    waited = time.monotonic() - started
    assert code == 1, log
    errors = error_lines(log)
    assert len(errors) == 1 and "Traceback" not in log, log
    # Gloo words it "Timed out ..." or "Application timeout caused pair closure"
    assert "lost contact" in errors[0], errors[0]
    assert "Timed out" in errors[0] or "Application timeout" in errors[0], errors[0]
    assert f"training.distributed.timeout ({TIMEOUT_S} s)" in errors[0], errors[0]
    print(f"rank 0 gave up {waited:.1f} s after rank 1 stopped (timeout {TIMEOUT_S} s)")


def test_relaunch_prefers_the_run_own_newest_checkpoint(tmp_path, monkeypatch, capsys):
    """In a relaunched worker (TORCHELASTIC_RESTART_COUNT > 0) an explicit --restart names where
    the first attempt started; the relaunch continues from the newest checkpoint instead, and
    falls back to the named one only while the output directory has none."""
    first = make_project(tmp_path / "first", numb_steps=4, save_freq=2)
    first_out = first.parent / "out"
    assert main(["train", str(first), "-o", str(first_out)]) == 0
    config = json.loads(first.read_text())
    config["training"]["numb_steps"] = 6
    first.write_text(json.dumps(config))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    capsys.readouterr()
    older = str(first_out / "model.ckpt-2.pt")
    assert main(["train", str(first), "-o", str(first_out), "--restart", older]) == 0
    err = capsys.readouterr().err
    assert "relaunched by torchrun (restart 1)" in err
    assert f"continuing from {first_out / 'model.ckpt-4.pt'} at step 4" in err, err

    second = make_project(tmp_path / "second", numb_steps=5)
    second_out = second.parent / "out"
    assert main(["train", str(second), "-o", str(second_out), "--restart", older]) == 0
    err = capsys.readouterr().err
    assert f"no checkpoint yet, using {older}" in err and "at step 2" in err, err


# ----------------------------------------------------------------------------- Gloo itself


def _collective_with_a_stalled_peer(op: str, flag: str) -> str:
    """Rank 1 idles until rank 0 has given up (``flag`` appears); rank 0 runs ``op`` alone."""
    import torch

    runtime = dist_rt.init_distributed("gloo", True, 2.0)
    if runtime.rank == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)  # without a word to the group: the peer must not learn anything from us
    try:
        if op == "all_reduce":  # gradients, validation sums, every vote (any_rank)
            dist_rt.all_reduce_sum(torch.ones(3))
        else:  # run_on_main's results; a tensor broadcast underneath, as in broadcast_module
            dist_rt.broadcast_object({"x": 1})
    except RuntimeError as exc:
        Path(flag).touch()
        os._exit(0 if "Timed out" in str(exc) else 3)
    Path(flag).touch()
    os._exit(4)


@pytest.mark.parametrize("op", ["all_reduce", "broadcast_object"])
def test_gloo_collectives_honour_the_timeout(op, tmp_path):
    """Every collective the trainer uses raises after the group's timeout when a peer does not
    come (rank 1 waits for rank 0 to give up first, so only the timeout can end rank 0's wait)."""
    flag = str(tmp_path / "gave-up")
    outcomes = spawn_workers(
        _collective_with_a_stalled_peer, 2, args=(op, flag), timeout=90, failure_grace=None
    )
    assert [o.returncode for o in outcomes] == [0, 0], "\n".join(o.describe() for o in outcomes)
    assert os.path.exists(flag)


@pytest.mark.parametrize(
    ("text", "collective"),
    [
        ("[../gloo/transport/tcp/pair.cc:538] Connection closed by peer", True),
        ("Application timeout caused pair closure", True),
        ("Timed out waiting 5000ms for recv operation to complete", True),
        ("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", False),
    ],
)
def test_collective_failures_are_recognised(text, collective):
    from mdtrain.train.training_loop import is_collective_failure

    assert is_collective_failure(RuntimeError(text)) is collective
