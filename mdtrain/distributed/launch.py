"""Where this process sits in the job: rank, world, local rank and rendezvous address, read
from the launcher's environment (torchrun, Open MPI's mpirun, Slurm's srun, PMI, or none).

Kept apart because it only reads variables and decides nothing about devices or backends:
``detect_launch_env`` takes the environment as an argument, so every launcher is testable
without starting one.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mdtrain.distributed.hostlist import first_host, parse_tasks_per_node
from mdtrain.errors import MDTrainError

log = logging.getLogger("mdtrain.distributed")

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as told by its launcher."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "none"  # torchrun | slurm | mpirun | pmi | none


def _int_var(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise MDTrainError(
            f"environment variable {name}={environ[name]!r} is not an integer"
        ) from None


def _first_int(environ: Mapping[str, str], names: Iterable[str], default: int | None) -> int | None:
    for name in names:
        if environ.get(name, "").strip():
            return _int_var(environ, name)
    return default


def _port(environ: Mapping[str, str], default: int) -> int:
    port = _first_int(environ, ["MASTER_PORT"], default)
    assert port is not None
    if not 0 < port < 65536:
        raise MDTrainError(f"environment variable MASTER_PORT={port} is not a TCP port")
    return port


# Slurm's step ids for the batch script, the extern step and interactive allocations: a
# process there was not started by `srun` as one of several tasks.
_NON_SRUN_STEPS = {
    "batch",
    "extern",
    "interactive",
    "4294967292",
    "4294967293",
    "4294967294",
    "4294967295",
}


def _slurm_port(environ: Mapping[str, str]) -> int:
    """MASTER_PORT, else a port fixed by job and step id, the same on every task of the step."""
    key = f"{environ.get('SLURM_JOB_ID', environ.get('SLURM_JOBID', ''))}.{_slurm_step(environ)}"
    return _port(environ, 15000 + zlib.crc32(key.encode()) % 15000)


def _slurm_step(environ: Mapping[str, str]) -> str:
    return environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", "")).strip()


def _mpi_master_addr(
    environ: Mapping[str, str], world: int, local_world: int | None, how: str
) -> str:
    addr = environ.get("MASTER_ADDR", "").strip()
    if addr:
        return addr
    if local_world == world:  # every rank on this node: loopback is right
        return "127.0.0.1"
    raise MDTrainError(
        f"launched by {how} over several nodes: export MASTER_ADDR=<host of rank 0> and "
        f"MASTER_PORT=<free port>, and pass them on (e.g. mpirun -x MASTER_ADDR -x MASTER_PORT)"
    )


def _srun_task(env: Mapping[str, str]) -> bool:
    """Started by `srun` as one task of a step, and not by an MPI launcher riding on srun
    (MPICH/Intel MPI's hydra starts one srun task per node, then sets PMI_* for the ranks)."""
    step = _slurm_step(env)
    if "SLURM_PROCID" not in env or not step or step in _NON_SRUN_STEPS:
        return False
    pmi_size = env.get("PMI_SIZE", "").strip()
    slurm_size = next(
        (
            env[k].strip()
            for k in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
            if env.get(k)
        ),
        "1",
    )
    return not pmi_size or pmi_size == slurm_size


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank and world from the launcher's variables: torchrun, mpirun, srun, PMI, or none.

    torchrun wins when present. Open MPI's variables come before Slurm's because mpirun inside a
    Slurm allocation starts its daemons with one `srun` task per node, so the inherited
    SLURM_PROCID would be a node index, not a rank (hydra's PMI_* likewise win when their
    world size disagrees with Slurm's). Slurm counts only inside an `srun` step
    (SLURM_STEP_ID set): a batch script or salloc shell has SLURM_PROCID=0 and SLURM_NTASKS=N
    but is one process, and waiting for N-1 peers that never come would hang.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        found = _torchrun_env(env)
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        found = _mpi_env(env, "OMPI_COMM_WORLD_", "mpirun")
    elif _srun_task(env):
        found = _slurm_env(env)
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        found = _mpi_env(env, "PMI_", "pmi")
    else:
        found = LaunchEnv(master_port=_port(env, DEFAULT_PORT))
    if not 0 <= found.rank < found.world_size:
        raise MDTrainError(
            f"{found.launcher}: rank {found.rank} outside a world of {found.world_size}"
        )
    if not 0 <= found.local_rank < max(found.local_world_size, 1):
        raise MDTrainError(
            f"{found.launcher}: local rank {found.local_rank} outside {found.local_world_size} local processes"
        )
    return found


def _torchrun_env(env: Mapping[str, str]) -> LaunchEnv:
    world = _int_var(env, "WORLD_SIZE")
    local_rank = _first_int(env, ["LOCAL_RANK"], 0)
    local_world = _first_int(env, ["LOCAL_WORLD_SIZE"], None)
    return LaunchEnv(
        rank=_int_var(env, "RANK"),
        world_size=world,
        local_rank=local_rank or 0,
        local_world_size=local_world if local_world is not None else max(world, 1),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1").strip() or "127.0.0.1",
        master_port=_port(env, DEFAULT_PORT),
        launcher="torchrun",
    )


def _mpi_env(env: Mapping[str, str], prefix: str, launcher: str) -> LaunchEnv:
    world = _int_var(env, prefix + "SIZE")
    if prefix == "PMI_":
        local_rank = _first_int(
            env, ["MPI_LOCALRANKID", "PMI_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"], 0
        )
        local_world = _first_int(
            env, ["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"], None
        )
    else:
        local_rank = _first_int(env, [prefix + "LOCAL_RANK"], 0)
        local_world = _first_int(env, [prefix + "LOCAL_SIZE"], None)
    how = "mpirun" if launcher == "mpirun" else "an MPI launcher (PMI)"
    return LaunchEnv(
        rank=_int_var(env, prefix + "RANK"),
        world_size=world,
        local_rank=local_rank or 0,
        local_world_size=local_world if local_world is not None else 1,
        master_addr=_mpi_master_addr(env, world, local_world, how) if world > 1 else "127.0.0.1",
        master_port=_port(env, DEFAULT_PORT),
        launcher=launcher,
    )


def _slurm_env(env: Mapping[str, str]) -> LaunchEnv:
    world = _first_int(env, ["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"], 1) or 1
    local_world = _first_int(env, ["SLURM_NTASKS_PER_NODE"], None)
    if local_world is None:
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if per_node:
            counts = parse_tasks_per_node(per_node)
            node = _first_int(env, ["SLURM_NODEID"], 0) or 0
            local_world = counts[min(node, len(counts) - 1)]
    nodelist = next(
        (
            env[k]
            for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if env.get(k)
        ),
        None,
    )
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        addr = first_host(nodelist) if nodelist else "127.0.0.1"
        if world > 1 and nodelist is None:
            log.debug("no SLURM_*NODELIST: assuming every task runs on this node")
    return LaunchEnv(
        rank=_int_var(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_first_int(env, ["SLURM_LOCALID"], 0) or 0,
        local_world_size=local_world or 1,
        master_addr=addr,
        master_port=_slurm_port(env),
        launcher="slurm",
    )
