"""Training runs as background processes, for preemption and rank-failure tests: a long
project, ``mdtrain train`` command lines (one process or torchrun), launching in a session of
its own, polling, finding torchrun's workers, killing, and comparing a resumed run with the
uninterrupted reference. The fixtures ``cleanup`` and ``reference_run`` (tests/conftest.py)
are built on ``Cleanup`` and ``ReferenceRuns``."""

from __future__ import annotations

import contextlib
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

from tests.helpers.processes import clean_env, torchrun_command
from tests.helpers.training import lcurve_rows, make_project, mdtrain_command

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


class ReferenceRuns:
    """The uninterrupted run on ``nproc`` ranks, started in the background on first use and
    shared by every test of the session (``finish()`` it); ``close`` kills what still runs."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.runs: dict[int, tuple[Launched, Path]] = {}

    def __call__(self, nproc: int) -> tuple[Launched, Path]:
        if nproc not in self.runs:
            root = self.tmp_path_factory.mktemp(f"reference{nproc}")
            inp = long_project(root)
            self.runs[nproc] = (launch(train_command(inp, nproc=nproc), root), root / "out")
        return self.runs[nproc]

    def close(self) -> None:
        for launched, _ in self.runs.values():
            kill_session(launched.proc)


def finished_reference(reference: tuple[Launched, Path]) -> Path:
    code, log = reference[0].finish()
    assert code == 0, log
    return reference[1]
