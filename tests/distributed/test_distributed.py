"""The distributed runtime: launcher detection, backend choice, devices, collectives with
failure propagation, gradient averaging, and rank-aware logging, in real Gloo processes."""

from __future__ import annotations

import ast
import logging
import re
import sys
import textwrap
import time

import pytest
import torch

import mdtrain.distributed as D
from mdtrain.errors import MDTrainError
from tests.helpers.processes import (
    clean_env,
    free_port,
    run_processes,
    run_torchrun,
    spawn_workers,
    torchrun_command,
)

RESULT = re.compile(r"RESULT rank=\d+ world=\d+ local=\d+ sum=[0-9.]+")

# --------------------------------------------------------------------------- launch environment


def test_hostlist_expansion():
    assert D.expand_hostlist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert D.expand_hostlist("a1,b[8-10],c") == ["a1", "b8", "b9", "b10", "c"]
    assert D.expand_hostlist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
    assert D.expand_hostlist("gpu-[009-011]") == ["gpu-009", "gpu-010", "gpu-011"]
    assert D.first_host("node[01-03,07]") == "node01"
    assert D.first_host("login2,node[5-6]") == "login2"
    assert D.first_host("10.0.0.5") == "10.0.0.5"
    for bad in ("node[01-03", "node[3-1]", "node[a-b]", ""):
        with pytest.raises(MDTrainError):
            D.first_host(bad)


def test_tasks_per_node():
    assert D.parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert D.parse_tasks_per_node("4") == [4]
    with pytest.raises(MDTrainError, match="tasks per node"):
        D.parse_tasks_per_node("2(3)")


def test_detect_torchrun():
    env = D.detect_launch_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "host1",
            "MASTER_PORT": "1234",
            # a torchrun inside an srun step: torchrun's variables win
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_STEP_ID": "0",
        }
    )
    assert env == D.LaunchEnv(5, 8, 1, 4, "host1", 1234, "torchrun")


def _slurm(**extra):
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "6",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "2(x3)",
        "SLURM_JOB_NODELIST": "cn[007-009]",
    }
    env.update(extra)
    return env


def test_detect_slurm():
    env = D.detect_launch_env(_slurm())
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 6, 1, 2)
    assert env.master_addr == "cn007" and env.launcher == "slurm"
    # the port is derived from the job and step ids: the same on every task, another per step
    assert env.master_port == D.detect_launch_env(_slurm(SLURM_PROCID="0")).master_port
    assert env.master_port != D.detect_launch_env(_slurm(SLURM_STEP_ID="1")).master_port
    assert 1024 < env.master_port < 65536
    # uneven nodes: this node's count; explicit MASTER_*; the step's node list first
    env = D.detect_launch_env(
        _slurm(
            SLURM_TASKS_PER_NODE="3,2(x2)",
            SLURM_NODEID="0",
            MASTER_PORT="2345",
            SLURM_STEP_NODELIST="cn[008-009]",
            SLURM_NTASKS_PER_NODE="",
        )
    )
    assert (env.local_world_size, env.master_port, env.master_addr) == (3, 2345, "cn008")
    assert D.detect_launch_env(_slurm(SLURM_NTASKS_PER_NODE="5")).local_world_size == 5
    assert D.detect_launch_env(_slurm(MASTER_ADDR="10.1.1.1")).master_addr == "10.1.1.1"


def test_slurm_batch_script_is_one_process():
    # sbatch --ntasks=6 runs the script once: without an srun step there are no peers to wait for
    env = _slurm(SLURM_PROCID="0")
    del env["SLURM_STEP_ID"]
    assert D.detect_launch_env(env).world_size == 1
    assert D.detect_launch_env(_slurm(SLURM_STEP_ID="extern")).world_size == 1


def test_detect_openmpi():
    base = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        # inherited from the srun that started mpirun's daemons: must be ignored
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_ID": "0",
    }
    with pytest.raises(MDTrainError, match="export MASTER_ADDR"):
        D.detect_launch_env(base)
    env = D.detect_launch_env({**base, "MASTER_ADDR": "head", "MASTER_PORT": "3000"})
    assert env == D.LaunchEnv(2, 4, 0, 2, "head", 3000, "mpirun")
    # every rank on one node: loopback needs no MASTER_ADDR
    one_node = {**base, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert D.detect_launch_env(one_node).master_addr == "127.0.0.1"


def test_detect_pmi():
    env = D.detect_launch_env(
        {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    )
    assert env == D.LaunchEnv(1, 2, 1, 2, "127.0.0.1", D.DEFAULT_PORT, "pmi")
    with pytest.raises(MDTrainError, match="MASTER_ADDR"):
        D.detect_launch_env(
            {"PMI_RANK": "1", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2"}
        )


def test_detect_none_and_bad_values():
    assert D.detect_launch_env({}) == D.LaunchEnv()
    assert D.detect_launch_env({"PATH": "/bin"}).world_size == 1
    with pytest.raises(MDTrainError, match="RANK"):
        D.detect_launch_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(MDTrainError, match="rank 2 outside a world of 2"):
        D.detect_launch_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(MDTrainError, match="MASTER_PORT"):
        D.detect_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"})


# --------------------------------------------------------------------------- backend and device


def test_backend_request_merge():
    assert D.resolve_backend_request("gloo", "nccl") == "gloo"
    assert D.resolve_backend_request(None, "NCCL") == "nccl"
    assert D.resolve_backend_request(None, None) == "auto"
    with pytest.raises(MDTrainError, match="'tcp'"):
        D.resolve_backend_request("tcp", None)


def _fake_availability(monkeypatch, nccl: bool, mpi: bool = False, gloo: bool = True):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(torch.distributed, "is_mpi_available", lambda: mpi)
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: gloo)


def test_auto_backend(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    _fake_availability(monkeypatch, nccl=False)
    assert D.choose_backend("auto", False, cpu) == "gloo"
    assert D.choose_backend("auto", False, gpu) == "gloo"  # CUDA present, NCCL not built in
    _fake_availability(monkeypatch, nccl=True)
    assert D.choose_backend("auto", False, gpu) == "nccl"
    assert D.choose_backend("auto", False, cpu) == "gloo"  # NCCL cannot move CPU tensors
    _fake_availability(monkeypatch, nccl=False, gloo=False)
    with pytest.raises(MDTrainError, match="neither NCCL nor Gloo"):
        D.choose_backend("auto", True, cpu)


def test_backend_fallback(monkeypatch, caplog):
    cpu = torch.device("cpu")
    _fake_availability(monkeypatch, nccl=False)
    logging.getLogger("mdtrain").propagate = True
    try:
        with caplog.at_level(logging.DEBUG, logger="mdtrain"):
            assert D.choose_backend("nccl", True, cpu) == "gloo"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "nccl" in warnings[0].getMessage()
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="mdtrain"):
            assert D.choose_backend("mpi", True, cpu, warn=False) == "gloo"
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        logging.getLogger("mdtrain").propagate = False
    with pytest.raises(MDTrainError, match="'nccl' is not available"):
        D.choose_backend("nccl", False, cpu)
    with pytest.raises(MDTrainError, match="'mpi' is not available"):
        D.choose_backend("mpi", False, cpu)
    _fake_availability(monkeypatch, nccl=True)
    assert D.choose_backend("nccl", False, torch.device("cuda", 0)) == "nccl"
    _fake_availability(monkeypatch, nccl=False, gloo=False)
    with pytest.raises(MDTrainError, match="'gloo' is not available"):
        D.choose_backend("gloo", True, cpu)


def test_select_device_cpu_threads(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(D.device, "_cpu_count", lambda: 8)  # where select_device looks it up
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = D.LaunchEnv(rank=1, world_size=4, local_rank=1, local_world_size=3)
    device = D.select_device(env)
    assert device.type == "cpu" and calls == [2]
    # under srun, the CPUs Slurm gave each task (it binds the task to them)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    D.select_device(D.LaunchEnv(local_world_size=3, launcher="slurm"))
    assert calls == [2, 4]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    D.select_device(env)
    assert calls == [2, 4]  # the user's OMP_NUM_THREADS is left alone


def test_select_device_cuda(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    device = D.select_device(D.LaunchEnv(rank=6, world_size=8, local_rank=2, local_world_size=4))
    assert device == torch.device("cuda", 2) and chosen == [device]
    with pytest.raises(MDTrainError, match="local rank 5"):
        D.select_device(D.LaunchEnv(rank=5, world_size=8, local_rank=5, local_world_size=8))
    monkeypatch.setattr(
        torch.cuda, "device_count", lambda: 1
    )  # one GPU per task (Slurm --gpus-per-task)
    assert (
        D.select_device(D.LaunchEnv(rank=3, world_size=4, local_rank=3, local_world_size=4)).index
        == 0
    )


# --------------------------------------------------------------------------- world of one


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 4, dtype=torch.float64)
        self.b = torch.nn.Linear(4, 1, dtype=torch.float64)
        self.unused_on_odd = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.register_buffer("shift", torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        y = self.b(torch.tanh(self.a(x))).sum() + self.shift.sum()
        return y + (self.unused_on_odd**2).sum() if use_extra else y


def test_world_of_one_helpers():
    rt = D.init_distributed("auto", environ={}, use_cuda=False)
    with rt:
        assert (rt.rank, rt.world_size, rt.is_main, rt.backend, rt.has_group) == (
            0,
            1,
            True,
            "gloo",
            False,
        )
        assert rt.device.type == "cpu"
        assert D.run_on_main(lambda x: x + 1, 41) == 42
        with pytest.raises(ValueError, match="boom"):
            D.run_on_main(_raise, "bug")
        assert D.broadcast_object({"a": 1}) == {"a": 1}
        assert D.any_rank(True) and not D.any_rank(False)
        t = torch.ones(3)
        assert D.all_reduce_sum(t) is t and t.sum().item() == 3
        D.barrier()
        model = _Tiny()
        assert D.wrap_ddp(model, rt) is model
        model(torch.ones(2, 3, dtype=torch.float64)).backward()
        before = [p.grad.clone() for p in model.parameters()]
        D.all_reduce_gradients(model.parameters())
        assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters(), strict=True))
        assert D.get_rank() == 0 and D.get_world_size() == 1


# --------------------------------------------------------------------------- worker functions


def _raise(kind: str):
    if kind == "user":
        raise MDTrainError("system data/sys1: frame 3 has no energy")
    raise ValueError("boom from rank 0")


def _batch(rank: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(2, 3) * (rank + 1)


def _worker_collectives():
    import os

    # "nccl" on this CPU: falls back to gloo with one warning (from rank 0 only)
    rt = D.init_distributed(os.environ["TEST_BACKEND"], fallback=True, timeout_s=30)
    with rt:
        log = logging.getLogger("mdtrain.test")
        log.info("info line from rank %d", rt.rank)
        if rt.rank == 1:
            log.warning("warning from rank %d", rt.rank)
        out = {
            "rank": rt.rank,
            "world": rt.world_size,
            "backend": rt.backend,
            "device": str(rt.device),
        }
        out["launch"] = (
            rt.launch.launcher,
            rt.local_rank,
            rt.local_world_size,
            rt.launch.master_addr,
        )
        out["bcast"] = D.broadcast_object({"from": rt.rank}, src=1)
        out["sum"] = D.all_reduce_sum(torch.tensor([rt.rank + 1.0])).item()
        out["any_true"] = D.any_rank(rt.rank == 1)
        out["any_false"] = D.any_rank(False)
        out["all"] = D.all_ranks(rt.rank == 0)
        out["main"] = D.run_on_main(lambda: {"computed_on": D.get_rank(), "big": list(range(1000))})
        D.barrier()
        # manual averaging: rank 1 never touches `unused_on_odd`; small buckets force several
        torch.manual_seed(0)
        model = _Tiny()
        model(_batch(rt.rank), use_extra=rt.rank % 2 == 0).backward()
        D.all_reduce_gradients(model.parameters(), bucket_mb=1e-4)
        out["manual"] = [p.grad.clone() for p in model.parameters()]
        # DDP on CPU (device_ids=None) reaches the same average; rank 1 starts from other
        # weights and a buffer, which the constructor replaces by rank 0's
        torch.manual_seed(rt.rank)
        ddp_model = _Tiny()
        ddp_model.shift.fill_(rt.rank)
        ddp = D.wrap_ddp(ddp_model, rt, find_unused_parameters=True)
        assert ddp is not ddp_model
        ddp(_batch(rt.rank), use_extra=rt.rank % 2 == 0).backward()
        out["ddp"] = [p.grad.clone() for p in ddp_model.parameters()]
        out["ddp_shift"] = ddp_model.shift.item()
        return out


def _worker_failure():
    rt = D.init_distributed("gloo", timeout_s=30)
    with rt:
        try:
            D.run_on_main(_raise, "bug")
        except (ValueError, MDTrainError) as exc:
            # the group is still usable after a failure was broadcast
            print(
                "SEEN",
                repr((type(exc).__name__, str(exc), D.broadcast_object("alive"))),
                flush=True,
            )
        D.run_on_main(_raise, "user")  # now let a user error escape on every rank


def _start_together(folder: str) -> None:
    """Wait until every worker has imported torch, so a short rendezvous timeout is safe."""
    import os
    from pathlib import Path

    Path(folder, f"ready{os.environ['RANK']}").touch()
    while len(list(Path(folder).glob("ready*"))) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.01)


def _die_after(seconds: float) -> None:
    import os

    time.sleep(seconds)
    os._exit(9)  # killed in the middle of its work (e.g. by the OOM killer), without a word


def _worker_dead_main(folder: str):
    _start_together(folder)
    # the work outlasts no timeout: rank 1 must learn of rank 0's death from the lost connection
    D.init_distributed("gloo", timeout_s=300)
    start = time.monotonic()
    try:
        D.run_on_main(_die_after, 1.0)
    except MDTrainError as exc:
        return (str(exc), time.monotonic() - start)
    return ("returned", time.monotonic() - start)


def _slow_answer(seconds: float) -> str:
    time.sleep(seconds)
    return "slow but fine"


def _worker_stalled_peer(folder: str):
    _start_together(folder)
    # no `with`: the atexit hook must destroy the group, else Gloo may abort at exit
    rt = D.init_distributed("gloo", timeout_s=2)
    # rank 0's own work may outlast the collective timeout: the others wait on the store
    answer = D.run_on_main(_slow_answer, 2.5)
    start = time.monotonic()
    if rt.rank == 1:
        time.sleep(3.5)  # alive but late: rank 0 must give up at its timeout, not wait for us
    try:
        D.barrier()
    except Exception as exc:
        return (answer, "raised", type(exc).__name__, time.monotonic() - start)
    return (answer, "returned", "", time.monotonic() - start)


# --------------------------------------------------------------------------- multi-process


@pytest.mark.multiprocess
def test_slurm_world_collectives_gradients_logging():
    """Two plain processes with Slurm's variables form a world of 2 (port from MASTER_PORT,
    address from the node list); collectives, gradient averaging and logging work in it."""
    port = free_port()

    def slurm_vars(rank: int) -> dict[str, str]:
        return {
            "SLURM_JOB_ID": "777",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_TASKS_PER_NODE": "2",
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TEST_BACKEND": "nccl",
        }

    outcomes = spawn_workers(
        _worker_collectives, 2, timeout=60, env=slurm_vars, launcher_vars=False
    )
    assert all(o.ok for o in outcomes), "\n".join(o.describe() for o in outcomes)
    res = [o.value for o in outcomes]
    for rank, out in enumerate(res):
        assert (out["rank"], out["world"], out["backend"], out["device"]) == (
            rank,
            2,
            "gloo",
            "cpu",
        )
        assert out["launch"] == ("slurm", rank, 2, "127.0.0.1")
        assert out["bcast"] == {"from": 1}
        assert out["sum"] == 3.0
        assert out["any_true"] is True and out["any_false"] is False and out["all"] is False
        assert out["main"] == {"computed_on": 0, "big": list(range(1000))}
    # reference: the same model on each rank's batch in this process, averaged by hand
    grads = []
    for rank in range(2):
        torch.manual_seed(0)
        model = _Tiny()
        model(_batch(rank), use_extra=rank % 2 == 0).backward()
        grads.append(
            [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        )
    expected = [(g0 + g1) / 2 for g0, g1 in zip(*grads, strict=True)]
    for out in res:
        for got_manual, got_ddp, want in zip(out["manual"], out["ddp"], expected, strict=True):
            torch.testing.assert_close(got_manual, want, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(got_ddp, want, rtol=1e-12, atol=1e-14)
        assert out["ddp_shift"] == 0.0  # rank 0's buffer
    # logging: information once (rank 0), rank 1 only warns, with its prefix
    err0, err1 = outcomes[0].stderr, outcomes[1].stderr
    assert "INFO info line from rank 0" in err0
    assert "info line" not in err1
    assert "[rank 1] WARNING warning from rank 1" in err1
    assert "warning from" not in err0
    assert err0.count("backend 'nccl' is not available") == 1
    assert "backend 'nccl'" not in err1


@pytest.mark.multiprocess
def test_run_on_main_failure_reaches_every_rank():
    outcomes = spawn_workers(_worker_failure, 2, timeout=60)
    assert not any(o.timed_out for o in outcomes), [o.describe() for o in outcomes]
    seen = [ast.literal_eval(o.stdout.split("SEEN ", 1)[1].splitlines()[0]) for o in outcomes]
    # a bug on rank 0: rank 0 re-raises it, rank 1 gets an MDTrainError naming it
    assert seen[0] == ("ValueError", "boom from rank 0", "alive")
    assert seen[1] == ("PeerFailure", "rank 0 failed with ValueError: boom from rank 0", "alive")
    # a user error on rank 0: every rank exits with rank 0's message
    assert outcomes[0].error_type == "MDTrainError"
    assert outcomes[0].error_message == "system data/sys1: frame 3 has no energy"
    assert outcomes[1].error_type == "PeerFailure"  # an MDTrainError naming its source
    assert outcomes[1].error_message == "rank 0: system data/sys1: frame 3 has no energy"
    assert all(o.returncode == 1 for o in outcomes)


@pytest.mark.multiprocess
def test_rank0_death_does_not_hang_the_others(tmp_path):
    outcomes = spawn_workers(_worker_dead_main, 2, (str(tmp_path),), timeout=60, failure_grace=30)
    assert outcomes[0].returncode == 9
    assert outcomes[1].ok, outcomes[1].describe()
    # rank 1 raised on its own (a hung rank 1 would be killed 30 s after rank 0 died, long
    # before its 300 s timeout): it learnt of the death from the closed connection
    message, _ = outcomes[1].value
    assert message.startswith("lost contact with rank 0 while waiting for its result")


@pytest.mark.multiprocess
def test_stalled_peer_times_out(tmp_path):
    outcomes = spawn_workers(
        _worker_stalled_peer, 2, (str(tmp_path),), timeout=60, failure_grace=30
    )
    assert outcomes[0].ok, outcomes[0].describe()
    answer, state, _, waited = outcomes[0].value
    assert answer == "slow but fine"
    assert outcomes[1].ok and outcomes[1].value[0] == "slow but fine", outcomes[1].describe()
    # without the timeout rank 0's barrier would complete once rank 1 arrives after 3.5 s
    assert state == "raised" and waited < 3.5, outcomes[0].value


_SCRIPT = textwrap.dedent(
    """
    import logging, os, sys
    import torch
    import mdtrain.distributed as D

    rt = D.init_distributed(sys.argv[1], fallback=True, timeout_s=30)
    log = logging.getLogger("mdtrain")
    log.info("world of %d via %s", rt.world_size, rt.launch.launcher)
    if rt.rank == 1:
        log.warning("rank one speaking")
    total = D.all_reduce_sum(torch.tensor([float(rt.rank + 1)])).item()
    print(f"RESULT rank={rt.rank} world={rt.world_size} local={rt.local_rank} sum={total}", flush=True)
    rt.shutdown()
    """
)


@pytest.mark.multiprocess
def test_torchrun_two_processes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    run = run_torchrun(script, ["auto"], nproc_per_node=2, timeout=90).check()
    lines = sorted(RESULT.findall(run.stdout))  # the ranks' lines may interleave
    assert lines == [
        "RESULT rank=0 world=2 local=0 sum=3.0",
        "RESULT rank=1 world=2 local=1 sum=3.0",
    ]
    assert run.stderr.count("world of 2 via torchrun") == 1
    assert "INFO world of 2 via torchrun" in run.stderr
    assert "[rank 1] WARNING rank one speaking" in run.stderr
    assert run.stderr.count("rank one speaking") == 1


@pytest.mark.multiprocess
def test_two_torchrun_agents_form_one_world(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    port = free_port()
    commands = [
        torchrun_command(
            script, ["gloo"], 1, nnodes=2, node_rank=i, rdzv_endpoint=f"127.0.0.1:{port}"
        )
        for i in range(2)
    ]
    runs = run_processes(commands, timeout=90, envs=[clean_env(), clean_env()])
    for run in runs:
        run.check()
    lines = sorted(line for run in runs for line in RESULT.findall(run.stdout))
    assert lines == [
        "RESULT rank=0 world=2 local=0 sum=3.0",
        "RESULT rank=1 world=2 local=0 sum=3.0",
    ]


def test_process_helpers_never_hang():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    failing = [sys.executable, "-c", "import sys; print('bye'); sys.exit(2)"]
    start = time.monotonic()
    (slow,) = run_processes([sleeper], timeout=0.5)
    assert slow.timed_out and slow.returncode is None
    bad, stuck = run_processes([failing, sleeper], timeout=60, failure_grace=0.5)
    assert (bad.returncode, bad.stdout.strip(), bad.timed_out) == (2, "bye", False)
    assert stuck.timed_out  # killed shortly after its peer failed, not at the 60 s deadline
    assert time.monotonic() - start < 30
