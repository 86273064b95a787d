"""The distributed runtime: launcher environment, device per rank, backend, process group,
and the few collectives the trainer needs.

One code path serves 1 and N processes: outside a launcher the world has size 1, no process
group is created, and every helper below still works (it just does the local thing). Work that
one rank does for all (neighbour statistics, model statistics) goes through ``run_on_main``,
which broadcasts rank 0's result *or its failure*, so no rank waits forever for a rank that died.

One job a module; import the names from here:

- ``hostlist``: Slurm's compact host lists and tasks-per-node strings.
- ``launch``: rank, world and rendezvous address from torchrun, mpirun, srun, PMI or none.
- ``backend``: NCCL, Gloo or MPI, with the fallback to Gloo.
- ``device``: the GPU or the CPU threads of each rank.
- ``runtime``: ``init_distributed`` forms the process group; ``Runtime`` shuts it down.
- ``failures``: a failure on one rank ends every rank within seconds, with its message.
- ``collectives``: rank, barrier, broadcasts, a gather to rank 0, sums, minima, maxima,
  flags, ``run_on_main``.
- ``gradients``: DDP, parameter broadcast, bucketed gradient averaging (overlapped with
  the backward, or after it).
"""

from mdtrain.distributed.backend import BACKENDS, choose_backend, resolve_backend_request
from mdtrain.distributed.collectives import (
    all_ranks,
    all_reduce_max,
    all_reduce_min,
    all_reduce_sum,
    any_rank,
    barrier,
    broadcast_object,
    broadcast_tensor,
    gather_to_main,
    get_rank,
    get_world_size,
    is_main_process,
    raise_together,
    run_on_main,
)
from mdtrain.distributed.device import select_device
from mdtrain.distributed.failures import PeerFailure
from mdtrain.distributed.gradients import (
    DEFAULT_BUCKET_MB,
    GradientBuckets,
    all_reduce_gradients,
    broadcast_module,
    wrap_ddp,
)
from mdtrain.distributed.hostlist import expand_hostlist, first_host, parse_tasks_per_node
from mdtrain.distributed.launch import DEFAULT_PORT, LaunchEnv, detect_launch_env
from mdtrain.distributed.runtime import Runtime, init_distributed

__all__ = [
    "BACKENDS",
    "DEFAULT_BUCKET_MB",
    "DEFAULT_PORT",
    "LaunchEnv",
    "PeerFailure",
    "Runtime",
    "all_ranks",
    "GradientBuckets",
    "all_reduce_gradients",
    "all_reduce_max",
    "all_reduce_min",
    "all_reduce_sum",
    "any_rank",
    "raise_together",
    "barrier",
    "broadcast_module",
    "broadcast_object",
    "broadcast_tensor",
    "gather_to_main",
    "choose_backend",
    "detect_launch_env",
    "expand_hostlist",
    "first_host",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "parse_tasks_per_node",
    "resolve_backend_request",
    "run_on_main",
    "select_device",
    "wrap_ddp",
]
