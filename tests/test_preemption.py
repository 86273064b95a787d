"""Preemption: SIGTERM or SIGUSR1 mid-training makes every rank finish the same step, write a
checkpoint of it and exit 0 without the `finished` marker; `--restart auto` then ends exactly
where an uninterrupted run ends (float64, same ranks): equal parameters, equal lcurve rows."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.mp_helpers import clean_env, run_process, torchrun_command
from tests.train_helpers import lcurve_rows, make_project, mdtrain_command

pytestmark = pytest.mark.multiprocess

NUMB_STEPS = 20  # long enough that a signal sent after step 2 arrives well before the end
SAVE_FREQ = 5
DEADLINE = 240.0  # seconds any one launch may take on a loaded machine


def long_project(root: Path, **training: object) -> Path:
    """A project whose run logs every step and saves every SAVE_FREQ steps."""
    options = {"numb_steps": NUMB_STEPS, "disp_freq": 1, "save_freq": SAVE_FREQ, **training}
    return make_project(root, **options)


def train_command(inp: Path, *extra: str, nproc: int = 1, launcher: Sequence[str] = ()) -> list:
    """``mdtrain train`` for one process, or under torchrun for ``nproc`` > 1."""
    args = ["train", str(inp), "-o", str(inp.parent / "out"), *extra]
    if nproc == 1:
        return mdtrain_command(*args)
    return torchrun_command("mdtrain", args, nproc, extra=["-m", *launcher])


# ----------------------------------------------------------------------------- processes


@dataclass
class Launched:
    """A started command with its output in files; ``finish`` waits with a deadline."""

    proc: subprocess.Popen
    log: Path

    def finish(self, timeout: float = DEADLINE) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_session(self.proc)
            raise AssertionError(f"still running after {timeout} s:\n{self.output()}") from None
        return code, self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def launch(cmd: Sequence[str], cwd: Path, env: dict | None = None, name: str = "run") -> Launched:
    """Start ``cmd`` in its own session (so a test can kill everything it started)."""
    log = cwd / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env or clean_env(),
            cwd=cwd,
            start_new_session=True,
        )
    return Launched(proc, log)


def kill_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Cleanup:
    """Kill the sessions of every launched process at the end of a test, whatever happened."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def __call__(self, launched: Launched) -> Launched:
        self.procs.append(launched.proc)
        return launched

    def close(self) -> None:
        for proc in self.procs:
            kill_session(proc)


@pytest.fixture
def cleanup():
    keeper = Cleanup()
    yield keeper
    keeper.close()


def wait_until(
    condition: Callable[[], bool], running: Launched, timeout: float = DEADLINE, what: str = ""
) -> None:
    """Poll ``condition`` until true; fail if ``running`` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if running.proc.poll() is not None:
            raise AssertionError(f"ended before {what}:\n{running.output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s:\n{running.output()}")
        time.sleep(0.05)


def logged_steps(path: Path) -> list[int]:
    """Steps of the complete rows of a (possibly growing) lcurve.out."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    rows = [ln for ln in lines if ln.endswith("\n") and ln.strip() and not ln.startswith("#")]
    return [int(ln.split()[0]) for ln in rows]


def has_row_after(path: Path, step: int) -> Callable[[], bool]:
    return lambda: any(s > step for s in logged_steps(path))


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def worker_of_rank(agent_pid: int, rank: int) -> int:
    """PID of torchrun's worker with the given RANK."""
    for pid in children(agent_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under torchrun {agent_pid}")


# ----------------------------------------------------------------------------- comparisons


def final_params(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / f"model.ckpt-{NUMB_STEPS}.pt", weights_only=True)["model_state"]


def assert_same_run(out: Path, reference: Path) -> None:
    """Bit-for-bit the same final parameters, and the same lcurve rows, one per step."""
    a, b = final_params(out), final_params(reference)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    rows = lcurve_rows(out / "lcurve.out")
    assert rows[:, 0].tolist() == list(range(1, NUMB_STEPS + 1))
    np.testing.assert_array_equal(rows, lcurve_rows(reference / "lcurve.out"))
    assert (out / "finished").read_text().strip() == str(NUMB_STEPS)


def stop_steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"stopping after step (\d+)", log)]


def checkpoint_index(out: Path) -> str:
    return (out / "checkpoint").read_text().strip()


# ----------------------------------------------------------------------------- tests


_REFERENCES: dict[int, tuple[Launched, Path]] = {}


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """``reference_run(nproc) -> (launched, out_dir)``: the uninterrupted run on ``nproc`` ranks,
    started in the background on first use and shared by every test (``finish()`` it)."""

    def start(nproc: int) -> tuple[Launched, Path]:
        if nproc not in _REFERENCES:
            root = tmp_path_factory.mktemp(f"reference{nproc}")
            inp = long_project(root)
            _REFERENCES[nproc] = (launch(train_command(inp, nproc=nproc), root), root / "out")
        return _REFERENCES[nproc]

    yield start
    for launched, _ in _REFERENCES.values():
        kill_session(launched.proc)


def finished_reference(reference: tuple[Launched, Path]) -> Path:
    code, log = reference[0].finish()
    assert code == 0, log
    return reference[1]


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
