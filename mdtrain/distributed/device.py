"""The device of each rank: its own GPU (``cuda:LOCAL_RANK``), or the CPU with a share of the
node's cores as threads. Chosen before any CUDA allocation and before the process group."""

from __future__ import annotations

import os

import torch

from mdtrain.distributed.launch import LaunchEnv
from mdtrain.errors import MDTrainError


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def select_device(env: LaunchEnv, use_cuda: bool | None = None) -> torch.device:
    """Fix this process's device before any CUDA allocation and before the process group.

    CUDA: ``cuda:LOCAL_RANK`` (or ``cuda:0`` when each task sees a single GPU) and
    ``torch.cuda.set_device``. CPU: the node's cores shared among its local processes (or
    Slurm's CPUs per task), unless OMP_NUM_THREADS says otherwise. ``use_cuda=False`` forces the CPU.
    """
    if use_cuda is None:
        use_cuda = torch.cuda.is_available()
    if use_cuda:
        count = torch.cuda.device_count()
        if count == 0:
            raise MDTrainError("CUDA was requested but no CUDA device is visible")
        if count == 1:
            index = 0
        elif env.local_rank < count:
            index = env.local_rank
        else:
            raise MDTrainError(
                f"local rank {env.local_rank} has no GPU of its own: {count} visible on this node "
                f"(start at most {count} processes per node, or set CUDA_VISIBLE_DEVICES)"
            )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        return device
    if not os.environ.get("OMP_NUM_THREADS", "").strip():
        torch.set_num_threads(_cpu_threads(env))
    return torch.device("cpu")


def _cpu_threads(env: LaunchEnv) -> int:
    """Threads per rank on a CPU: Slurm's CPUs per task when it gives them (the task is bound
    to them), else the usable cores shared by the ranks on this node."""
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if env.launcher == "slurm" and per_task.isdigit() and int(per_task) > 0:
        return min(int(per_task), _cpu_count())
    return max(1, _cpu_count() // max(env.local_world_size, 1))
