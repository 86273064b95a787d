"""A rank that fails with an error of its own ends the whole job within seconds, with its
message, whatever the other ranks are doing (in a collective, waiting for rank 0, busy with
work of their own), under torchrun and under a plain srun-style launch; never after
training.distributed.timeout (left at its default, 1800 s, here)."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import mdtrain
from mdtrain import distributed as dist_rt
from mdtrain.distributed.failures import FailureChannel, describe, is_consequence
from mdtrain.errors import MDTrainError
from tests.helpers.processes import (
    clean_env,
    free_port,
    rank_elsewhere,
    run_processes,
    slurm_vars,
    spawn_workers,
    torchrun_command,
)
from tests.helpers.training import make_project, mdtrain_command

pytestmark = pytest.mark.multiprocess

DEADLINE_S = 60  # the requirement: the whole job ends within a minute


def _errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in f" {line}"]


@pytest.mark.parametrize("failing", [1, 0])
@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_a_rank_missing_a_system_ends_the_job_with_its_message(launcher, failing, tmp_path):
    """One rank sees no data (its node lacks the path: it starts in another folder, where the
    input's relative `data/` does not exist); the others pass that point and wait for it in
    a collective (or, if rank 0 fails, for rank 0's result)."""
    inp = make_project(tmp_path / "node", numb_steps=50)
    other = tmp_path / "other-node"
    other.mkdir()
    shutil.copy(inp, other / "input.json")
    missing = other / "data" / "train_a"
    args = ["train", "input.json", "-o", "out"]
    site = tmp_path / "site"
    if launcher == "torchrun":
        commands = [torchrun_command("mdtrain", args, 2, extra=["-m"])]
        envs = [rank_elsewhere(clean_env(), failing, other, site)]
    else:
        port = free_port()
        commands = [mdtrain_command(*args)] * 2
        envs = [
            rank_elsewhere(clean_env(slurm_vars(rank, 2, port)), failing, other, site)
            for rank in (0, 1)
        ]
    started = time.monotonic()
    runs = run_processes(commands, DEADLINE_S, envs, cwd=inp.parent, failure_grace=None)
    took = time.monotonic() - started
    log = "\n".join(run.stderr + run.stdout for run in runs)
    assert not any(run.timed_out for run in runs), log
    assert all(run.returncode not in (0, None) for run in runs), log
    message = f"input.json: training.training_data.systems: system {missing} does not exist"
    prefix = f"[rank {failing}] " if failing else ""
    own = [line for line in _errors(log) if "stopping:" not in line]
    assert len(own) == 1 and own[0].startswith(f"{prefix}ERROR {message}"), log
    others = [line for line in _errors(log) if "stopping:" in line]
    other_prefix = "" if failing else "[rank 1] "
    want = f"{other_prefix}ERROR stopping: rank {failing} failed: {message}"
    assert all(line.startswith(want) for line in others), log
    if launcher == "srun":  # no agent ends the other rank: it says why it stops
        assert len(others) == 1, log
    assert f'File "{os.path.dirname(mdtrain.__file__)}' not in log, log  # no traceback of ours
    print(f"{launcher}, rank {failing} failing: the job ended {took:.1f} s after its start")


# ----------------------------------------------------------------------------- the watcher


def _fail_or_work(failing: int, how: str) -> str:
    """Rank ``failing`` fails inside the run's block; the other rank has work of its own
    that would take minutes (rank 0's statistics, say): it is in no collective, so nothing
    but the watcher can stop it."""
    with dist_rt.init_distributed("gloo") as runtime:
        dist_rt.barrier()  # both in the block: no rank is still forming the group
        if runtime.rank == failing:
            if how == "vanish":
                os._exit(9)  # killed without a word (its store goes with it)
            raise MDTrainError("system data/node2: set.000/force.npy is truncated")
        time.sleep(120)
    return "slept"


def test_the_watcher_stops_a_rank_busy_with_its_own_work():
    outcomes = spawn_workers(_fail_or_work, 2, (1, "raise"), timeout=DEADLINE_S, failure_grace=None)
    busy, failed = outcomes
    assert not busy.timed_out and busy.returncode == 1, busy.describe()
    assert failed.error_message == "system data/node2: set.000/force.npy is truncated"
    assert busy.stderr.count("ERROR") == 1, busy.stderr
    assert "ERROR stopping: rank 1 failed: system data/node2: set.000/force.npy" in busy.stderr


def test_a_vanished_store_host_stops_the_others():
    """Rank 0 serves the job's store outside torchrun; when it dies, the others stop too."""
    outcomes = spawn_workers(
        _fail_or_work, 2, (0, "vanish"), timeout=DEADLINE_S, failure_grace=None
    )
    host, busy = outcomes
    assert host.returncode == 9
    assert not busy.timed_out and busy.returncode == 1, busy.describe()
    assert "[rank 1] ERROR stopping: lost contact with the job's store" in busy.stderr


def _finish_apart() -> float:
    """Rank 1 finishes well after rank 0, which serves the store: rank 0 must wait for it,
    or rank 1's watcher would take the closed store for a failure."""
    with dist_rt.init_distributed("gloo") as runtime:
        dist_rt.barrier()
        if runtime.rank == 1:
            time.sleep(3.0)  # three polls of the watcher
        began = time.monotonic()
    return time.monotonic() - began


def test_a_clean_finish_is_no_failure():
    outcomes = spawn_workers(_finish_apart, 2, timeout=DEADLINE_S)
    assert all(o.ok for o in outcomes), "\n".join(o.describe() for o in outcomes)
    assert outcomes[0].value > 1.0  # the host waited for rank 1 to stop watching


# ----------------------------------------------------------------------------- decisions


def _channels(world_size: int) -> tuple[torch.distributed.Store, list[FailureChannel]]:
    """Every rank's channel on one in-process store (no group, no watcher thread)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, multi_tenant=True)
    return store, [FailureChannel(store, r, world_size, False, "here") for r in range(world_size)]


def test_the_first_failure_stands_and_consequences_quote_it():
    store, channels = _channels(4)
    assert channels[1].report(MDTrainError("system a: no energy")) is None  # published, kept
    assert channels[2].report(OSError("No space left on device")) is None  # its own error, kept
    record = torch.distributed.PrefixStore("mdtrain/failures/", store).get("first-failure")
    assert record == b"1\nsystem a: no energy"
    # a collective that lost its peer says so; the job's record says why
    replaced = channels[0].report(RuntimeError("[pair.cc:553] Connection closed by peer"))
    assert isinstance(replaced, dist_rt.PeerFailure)
    assert str(replaced) == "stopping: rank 1 failed: system a: no energy"
    try:
        raise MDTrainError("rank 3: lost contact with the other ranks") from RuntimeError("Gloo")
    except MDTrainError as exc:
        replaced = channels[3].report(exc)
    assert str(replaced) == "stopping: rank 1 failed: system a: no energy"
    # run_on_main's relay already quotes its source
    _, more = _channels(2)
    assert more[0].report(ValueError("bug")) is None
    assert (
        more[1].report(dist_rt.PeerFailure("rank 0 failed with ValueError: bug", 0, quotes=True))
        is None
    )


def test_consequences_are_told_from_errors_of_their_own():
    assert is_consequence(RuntimeError("Connection closed by peer [127.0.0.1]:4242"))
    assert is_consequence(dist_rt.PeerFailure("lost contact with rank 0"))
    assert not is_consequence(RuntimeError("shape mismatch"))
    assert not is_consequence(MDTrainError("system a: no energy"))
    assert describe(ValueError("disk full\nmore")) == "ValueError: disk full"
    assert describe(MDTrainError("system a: no energy")) == "system a: no energy"
