"""Run code in several real processes for tests: N Python workers wired like torchrun
(loopback rendezvous on a free port), or `torchrun` itself as a subprocess.

Every process gets a deadline; on timeout (or when a worker fails and the others do not
finish within a grace period) the whole process group of each child is killed, so a broken
collective shows up as a test failure, never as a hung test run.

    results = run_workers(my_fn, 2, args=(x,))          # fn(*args) on each rank, by rank
    outcomes = spawn_workers(my_fn, 2)                   # + stderr, exceptions, exit codes
    proc = run_torchrun(script, nproc_per_node=2)        # CompletedRun with stdout/stderr
    proc = run_ranks(cmd, 2, timeout=120)                # cmd as 2 ranks, without the agent

Workers are plain ``python tests/helpers/processes.py <payload>`` subprocesses: ``fn`` must
be a module-level function importable from the parent's ``sys.path`` (a test module is fine).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Launcher variables a worker must not inherit from the environment the tests run in.
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_", "GROUP_")
_LAUNCH_NAMES = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "NODE_RANK",
}


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(extra: Mapping[str, str] | None = None, threads: int = 1) -> dict[str, str]:
    """The current environment without launcher variables, with modest thread counts."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_NAMES and not k.startswith(_LAUNCH_PREFIXES)
    }
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    # the parent's import path, so a worker can unpickle functions from test modules ("" is the
    # current folder here, but would be the script's folder in a child)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def torchrun_vars(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun would give ``rank`` of a one-node world on loopback."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def slurm_vars(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables ``srun`` gives task ``rank`` of a one-node step (no torchrun variables)."""
    return {
        "SLURM_JOB_ID": "777",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": str(world_size),
        "SLURM_TASKS_PER_NODE": str(world_size),
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def rank_elsewhere(env: Mapping[str, str], rank: int, folder: Path, site: Path) -> dict[str, str]:
    """``env`` in which the process of ``rank`` (RANK or SLURM_PROCID) starts in ``folder``.

    A ``sitecustomize`` module written to ``site`` changes that one rank's working folder before
    anything runs, so a relative input path names another file there: one rank sees another
    file system (a path missing on one node), even under torchrun, which starts every worker
    alike.
    """
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if (os.environ.get('RANK') or os.environ.get('SLURM_PROCID')) == "
        f"{str(rank)!r}:\n"
        f"    os.chdir({str(folder)!r})\n"
    )
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join([str(site), out.get("PYTHONPATH", "")])
    return out


# --------------------------------------------------------------------------- processes


@dataclass
class CompletedRun:
    """One finished (or killed) subprocess."""

    args: list[str]
    returncode: int | None  # None: killed on timeout
    stdout: str
    stderr: str
    timed_out: bool = False

    def check(self) -> CompletedRun:
        if self.timed_out or self.returncode != 0:
            raise AssertionError(self.describe())
        return self

    def describe(self) -> str:
        state = "timed out" if self.timed_out else f"exit code {self.returncode}"
        return (
            f"{' '.join(self.args)}: {state}\n--- stdout ---\n{self.stdout[-4000:]}"
            f"\n--- stderr ---\n{self.stderr[-4000:]}"
        )


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's whole session (torchrun's workers too), even if the child itself exited."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.kill()
    proc.wait()


def python_without_mdtrain(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -c script args`` with an environment that cannot reach mdtrain (no
    PYTHONPATH, no site beyond the interpreter's): what a deployment without it sees."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )


def run_processes(
    commands: Sequence[Sequence[str]],
    timeout: float,
    envs: Sequence[Mapping[str, str]] | None = None,
    cwd: str | os.PathLike | None = None,
    failure_grace: float | None = 15.0,
) -> list[CompletedRun]:
    """Start every command at once, wait for all of them, and kill what is left at the deadline.

    When one command fails, the others get ``failure_grace`` more seconds (``None``: until the
    deadline) before they are killed too: a rank stuck waiting for a dead peer ends quickly.
    Output goes to temporary files (pipes could fill and block a chatty child).
    """
    envs = envs or [clean_env()] * len(commands)
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(tempfile.TemporaryFile()) for _ in commands]
        errs = [stack.enter_context(tempfile.TemporaryFile()) for _ in commands]
        killed = _run_all(commands, envs, cwd, outs, errs, procs, timeout, failure_grace)
        return [
            CompletedRun(
                args=list(cmd),
                returncode=None if was_killed else p.returncode,
                stdout=_read(out),
                stderr=_read(err),
                timed_out=was_killed,
            )
            for cmd, p, out, err, was_killed in zip(
                commands, procs, outs, errs, killed, strict=True
            )
        ]


def _read(fh) -> str:  # noqa: ANN001
    fh.seek(0)
    return fh.read().decode(errors="replace")


def _run_all(commands, envs, cwd, outs, errs, procs, timeout, failure_grace) -> list[bool]:  # noqa: ANN001
    try:
        for cmd, env, out, err in zip(commands, envs, outs, errs, strict=True):
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    stdout=out,
                    stderr=err,
                    env=dict(env),
                    cwd=cwd,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        killed = [False] * len(procs)
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if failure_grace is not None and any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + failure_grace)
                failure_grace = None  # start the grace period once
            if time.monotonic() > deadline:
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        killed[i] = True
                        _kill_group(p)
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # an exception above (e.g. KeyboardInterrupt) must not leave orphans
            _kill_group(p)
    return killed


def run_process(
    cmd: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, cwd=None
) -> CompletedRun:
    """One command with a deadline (see ``run_processes``)."""
    return run_processes([cmd], timeout, [env or clean_env()], cwd=cwd)[0]


def run_ranks(
    cmd: Sequence[str],
    world_size: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> CompletedRun:
    """``cmd`` as the ``world_size`` ranks of a one-node job, each started with the variables
    torchrun would give it (loopback, a free port) but without torchrun's agent: one process
    less to start, for tests whose subject is the training, not the launcher (torchrun itself
    is tested with ``run_torchrun``). The ranks' outputs joined in rank order; the exit code
    is the first failing rank's (``None`` if one was killed at the deadline)."""
    port = free_port()
    envs = [
        clean_env({**(env or {}), **torchrun_vars(r, world_size, port)}) for r in range(world_size)
    ]
    runs = run_processes([cmd] * world_size, timeout, envs, cwd=cwd)
    failed = [r for r in runs if r.timed_out or r.returncode != 0]
    return CompletedRun(
        args=[*cmd, f"(as {world_size} ranks)"],
        returncode=None if any(r.timed_out for r in runs) else (failed or runs)[0].returncode,
        stdout="".join(r.stdout for r in runs),
        stderr="".join(r.stderr for r in runs),
        timed_out=any(r.timed_out for r in runs),
    )


# --------------------------------------------------------------------------- python workers


@dataclass
class WorkerOutcome:
    """What one rank did: its return value or its exception, and everything it printed."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    returncode: int | None = None
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok"
        if self.error_type:
            head = (
                f"rank {self.rank}: {self.error_type}: {self.error_message}\n{self.traceback or ''}"
            )
        else:
            state = "timed out (killed)" if self.timed_out else f"exit code {self.returncode}"
            head = f"rank {self.rank}: {state}"
        return f"{head}\n--- stderr of rank {self.rank} ---\n{self.stderr[-4000:]}"


class WorkerError(AssertionError):
    """Some rank failed; the message holds every failing rank's error and stderr."""


def spawn_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    *,
    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
    launcher_vars: bool = True,
    failure_grace: float | None = 15.0,
    threads: int = 1,
) -> list[WorkerOutcome]:
    """Run ``fn(*args)`` in ``world_size`` fresh Python processes; outcomes by rank.

    ``launcher_vars`` sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=<free port>); switch it off to emulate
    another launcher with ``env``, a dict or ``rank -> dict`` (e.g. SLURM_PROCID). The port is
    also in each worker's ``MDTRAIN_TEST_PORT``. Processes do not form a group by themselves:
    ``fn`` calls ``mdtrain.distributed.init_distributed`` (or not).
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="mdtrain-workers-") as tmp:
        payload = Path(tmp) / "payload.pkl"
        payload.write_bytes(pickle.dumps((fn, tuple(args))))
        commands, envs = [], []
        for rank in range(world_size):
            extra = {"MDTRAIN_TEST_PORT": str(port)}
            if launcher_vars:
                extra.update(torchrun_vars(rank, world_size, port))
            extra.update(env(rank) if callable(env) else (env or {}))
            envs.append(clean_env(extra, threads))
            commands.append(
                [sys.executable, __file__, str(payload), str(Path(tmp) / f"result{rank}.pkl")]
            )
        runs = run_processes(commands, timeout, envs, failure_grace=failure_grace)
        outcomes = []
        for rank, run in enumerate(runs):
            result_file = Path(tmp) / f"result{rank}.pkl"
            outcome = WorkerOutcome(
                rank=rank, ok=False, returncode=run.returncode, timed_out=run.timed_out
            )
            if result_file.exists():
                status, *rest = pickle.loads(result_file.read_bytes())
                if status == "ok":
                    outcome.ok, outcome.value = run.returncode == 0, rest[0]
                else:
                    outcome.error_type, outcome.error_message, outcome.traceback = rest
            outcome.stdout, outcome.stderr = run.stdout, run.stderr
            outcomes.append(outcome)
    return outcomes


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """``fn(*args)`` on every rank; the return values by rank, or ``WorkerError`` if any
    rank raised, crashed or timed out (see ``spawn_workers`` for the options)."""
    outcomes = spawn_workers(fn, world_size, args, timeout, **kwargs)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise WorkerError("\n\n".join(o.describe() for o in failed))
    return [o.value for o in outcomes]


def _worker_main(payload_path: str, result_path: str) -> int:
    """Entry point of a worker process: load ``fn`` (its module is importable because
    ``clean_env`` put the parent's ``sys.path`` in PYTHONPATH), run it, pickle what happened."""
    with open(payload_path, "rb") as fh:
        fn, args = pickle.load(fh)
    try:
        record: tuple = ("ok", fn(*args))
        code = 0
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt too
        record = ("error", type(exc).__name__, str(exc), traceback.format_exc())
        code = 1
    try:
        data = pickle.dumps(record)
    except Exception as exc:  # an unpicklable return value is a failure of the test itself
        data = pickle.dumps(("error", type(exc).__name__, f"cannot pickle the result: {exc}", ""))
        code = 1
    with open(result_path, "wb") as fh:
        fh.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


# --------------------------------------------------------------------------- torchrun


def torchrun_command(
    script: str | os.PathLike,
    script_args: Sequence[str] = (),
    nproc_per_node: int = 2,
    *,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    master_port: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """A ``python -m torch.distributed.run`` command line.

    One node with no endpoint: ``--standalone``. Several agents: either the c10d rendezvous
    (``rdzv_endpoint``) or the static form (``master_port`` with ``node_rank``).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and rdzv_endpoint is None and master_port is None:
        cmd.append("--standalone")
    else:
        cmd.append(f"--nnodes={nnodes}")
        if rdzv_endpoint is not None:
            cmd += [
                f"--rdzv-backend={rdzv_backend}",
                f"--rdzv-endpoint={rdzv_endpoint}",
                "--rdzv-id=mdtrain-test",
            ]
        if master_port is not None:
            cmd += ["--master-addr=127.0.0.1", f"--master-port={master_port}"]
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
    cmd += list(extra) + [str(script)] + [str(a) for a in script_args]
    return cmd


def run_torchrun(
    script: str | os.PathLike,
    script_args: Sequence[str] = (),
    nproc_per_node: int = 2,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    **kwargs: Any,
) -> CompletedRun:
    """Run ``torchrun`` on one node with a deadline; the agent and its workers are killed at it."""
    cmd = torchrun_command(script, script_args, nproc_per_node, **kwargs)
    return run_process(cmd, timeout, clean_env(env), cwd=cwd)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1], sys.argv[2]))
