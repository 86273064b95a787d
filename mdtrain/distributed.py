"""The distributed runtime: launcher environment, device per rank, backend, process group,
and the few collectives the trainer needs.

One code path serves 1 and N processes: outside a launcher the world has size 1, no process
group is created, and every helper below still works (it just does the local thing). Work that
one rank does for all (neighbour statistics, model statistics) goes through ``run_on_main``,
which broadcasts rank 0's result *or its failure*, so no rank waits forever for a rank that died.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import pickle
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mdtrain.errors import MDTrainError
from mdtrain.log import setup_logging

log = logging.getLogger("mdtrain.distributed")
T = TypeVar("T")

BACKENDS = ("auto", "nccl", "gloo", "mpi")
DEFAULT_PORT = 29500

# --------------------------------------------------------------------------- launch environment


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


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm compact host list: ``"a[01-03,07],b1"`` → a01 a02 a03 a07 b1.

    Zero padding follows the lower bound of each range; several bracket groups in one name
    (``r[1-2]n[1-2]``) expand as a product, like Slurm does.
    """
    hosts: list[str] = []
    for name in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_name(name))
    return hosts


def first_host(hostlist: str) -> str:
    """The first host of a compact host list (where rank 0 runs for a Slurm step)."""
    names = _split_top_level(hostlist.strip())
    if not names:
        raise MDTrainError(f"empty Slurm node list {hostlist!r}")
    return _expand_name(names[0])[0]


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if depth < 0 or depth > 1:
            raise MDTrainError(f"cannot parse Slurm node list {text!r}: unbalanced brackets")
    if depth != 0:
        raise MDTrainError(f"cannot parse Slurm node list {text!r}: unbalanced brackets")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_name(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    values: list[str] = []
    for item in match.group(1).split(","):
        item = item.strip()
        if re.fullmatch(r"\d+", item):
            values.append(item)
        elif (m := re.fullmatch(r"(\d+)-(\d+)", item)) is not None:
            lo, hi = m.group(1), m.group(2)
            if int(hi) < int(lo):
                raise MDTrainError(f"cannot parse Slurm node list {name!r}: range {item!r}")
            values.extend(str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1))
        else:
            raise MDTrainError(f"cannot parse Slurm node list {name!r}: item {item!r}")
    return [head + v + rest for v in values for rest in _expand_name(tail)]


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` form: ``"2(x3),1"`` → [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise MDTrainError(f"cannot parse Slurm tasks per node {value!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


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


# --------------------------------------------------------------------------- backend and device


def resolve_backend_request(cli_value: str | None, config_value: str | None) -> str:
    """The command line wins over input.json; neither given means "auto"."""
    value = cli_value or config_value or "auto"
    value = value.strip().lower()
    if value not in BACKENDS:
        raise MDTrainError(f"backend {value!r} is not one of {', '.join(BACKENDS)}")
    return value


def _available(backend: str, device: torch.device) -> bool:
    if not dist.is_available():
        return False
    if backend == "nccl":  # NCCL moves CUDA tensors only
        return device.type == "cuda" and dist.is_nccl_available()
    if backend == "gloo":
        return dist.is_gloo_available()
    if backend == "mpi":
        return dist.is_mpi_available()
    return False


def choose_backend(
    requested: str, fallback: bool, device: torch.device, *, warn: bool = True
) -> str:
    """Pick the process-group backend.

    ``auto`` is NCCL for a CUDA device when NCCL is built in, else Gloo. An explicit request
    that cannot work here (NCCL on a CPU-only build or a CPU device, MPI without an MPI build)
    falls back to Gloo with one warning when ``fallback``, else raises. ``warn=False`` keeps the
    fallback message at debug level (ranks other than 0 take the same decision silently).
    """
    requested = resolve_backend_request(requested, None)
    if requested == "auto":
        chosen = "nccl" if _available("nccl", device) else "gloo"
        if not _available(chosen, device):
            raise MDTrainError("torch.distributed has neither NCCL nor Gloo in this PyTorch build")
        return chosen
    if _available(requested, device):
        return requested
    why = {
        "nccl": "NCCL needs a CUDA device and a PyTorch built with NCCL"
        f" (device here: {device.type}, NCCL built in: {dist.is_available() and dist.is_nccl_available()})",
        "mpi": "this PyTorch was built without MPI support",
        "gloo": "this PyTorch was built without Gloo",
    }[requested]
    if not fallback or requested == "gloo" or not _available("gloo", device):
        raise MDTrainError(f"backend {requested!r} is not available: {why}")
    log.log(
        logging.WARNING if warn else logging.DEBUG,
        "backend %r is not available (%s): using 'gloo'",
        requested,
        why,
    )
    return "gloo"


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


# --------------------------------------------------------------------------- runtime


@dataclass
class Runtime:
    """This process's place in the run; a context manager that shuts the group down on exit."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launch: LaunchEnv = field(default_factory=LaunchEnv)
    has_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shutdown(self) -> None:
        """Destroy the process group (idempotent).

        Garbage is collected first: a dropped DDP wrapper sits in a reference cycle that keeps
        the group's C++ threads alive, and freeing it only at interpreter exit aborts the
        process ("terminate called without an active exception", seen with Gloo).
        """
        if self.has_group and dist.is_available() and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
        self.has_group = False

    def _at_exit(self) -> None:
        # runs while the interpreter is still whole: free DDP cycles still holding the group,
        # and destroy a Gloo group the caller left (NCCL's destroy can block on a dead peer)
        gc.collect()
        if self.backend == "gloo":
            self.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def init_distributed(
    backend_request: str = "auto",
    fallback: bool = True,
    timeout_s: float = 1800.0,
    *,
    environ: Mapping[str, str] | None = None,
    use_cuda: bool | None = None,
) -> Runtime:
    """Detect the launcher, set logging and the device, and form the process group if N > 1.

    Use the result as a context manager (``with init_distributed(...) as runtime:``) so the
    group is destroyed however the block ends.

    ``timeout_s`` bounds the rendezvous and every collective: when a rank dies or stalls, the
    others raise within it instead of hanging. With NCCL the group also carries Gloo for CPU
    tensors ("cpu:gloo,cuda:nccl"), so object broadcasts and flags need no GPU round trip.
    """
    env = detect_launch_env(environ)
    setup_logging(env.rank, env.world_size)
    device = select_device(env, use_cuda)
    backend = choose_backend(backend_request, fallback, device, warn=env.rank == 0)
    runtime = Runtime(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        device=device,
        backend=backend,
        launch=env,
    )
    if env.world_size > 1:
        _init_group(env, backend, device, timeout_s)
        runtime.has_group = True
        # a group (or a DDP wrapper holding it) still alive at interpreter exit can abort the
        # process; see Runtime._at_exit
        atexit.register(runtime._at_exit)
    log.debug(
        "rank %d of %d (local %d of %d) on %s, backend %s, launcher %s",
        env.rank, env.world_size, env.local_rank, env.local_world_size, device, backend, env.launcher,
    )  # fmt: skip
    return runtime


def _attempt_store(env: LaunchEnv, timeout: datetime.timedelta) -> dist.Store | None:
    """After a torchrun relaunch, the agent's store under a per-attempt prefix (else None).

    torchrun keeps one store for all attempts, so without the prefix a relaunched rank can read
    the keys of the attempt before (a dead peer's Gloo address: "Connection refused").
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in ("", "0"):
        return None
    store = dist.TCPStore(
        env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"mdtrain/attempt-{attempt}/", store)


def _init_group(env: LaunchEnv, backend: str, device: torch.device, timeout_s: float) -> None:
    if dist.is_initialized():
        raise MDTrainError("the process group already exists: init_distributed was called twice")
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"{env.launcher}, rank {env.rank} of {env.world_size}, master {env.master_addr}:{env.master_port}"
    try:
        if backend == "mpi":
            dist.init_process_group("mpi", timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
            spec = (
                "cpu:gloo,cuda:nccl" if backend == "nccl" and dist.is_gloo_available() else backend
            )
            store = _attempt_store(env, timeout)
            dist.init_process_group(
                spec,
                init_method=None if store is not None else "env://",
                store=store,
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
    except (RuntimeError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MDTrainError(
            f"cannot form the process group ({where}, backend {backend}): {first}"
        ) from exc
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise MDTrainError(
            f"process group disagrees with the launcher ({where}): "
            f"rank {dist.get_rank()} of {dist.get_world_size()}"
        )


# --------------------------------------------------------------------------- collectives


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank (0 outside a process group)."""
    return dist.get_rank() if _active() else 0


def get_world_size() -> int:
    """The number of processes (1 outside a process group)."""
    return dist.get_world_size() if _active() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def _cpu_collectives() -> bool:
    """Whether the group moves CPU tensors (Gloo, MPI, or the Gloo half of "cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend()).lower()
    return "gloo" in backend or "mpi" in backend


def _tensor_device() -> torch.device:
    """Where small flag tensors go: the CPU unless the group can only move CUDA tensors."""
    if _cpu_collectives():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _needs_move(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and not _cpu_collectives()


def barrier() -> None:
    """Wait for every rank (no-op in a world of 1)."""
    if _active():
        dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (pickled; keep it modest in size)."""
    if not _active():
        return obj
    box = [obj if get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]  # type: ignore[return-value]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place and return it (copies through the group's device if
    the tensor lives elsewhere, e.g. a CPU tensor under pure NCCL)."""
    if not _active():
        return tensor
    if not _needs_move(tensor):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor
    moved = tensor.to(_tensor_device())
    dist.all_reduce(moved, op=dist.ReduceOp.SUM)
    tensor.copy_(moved)
    return tensor


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one: collective stop/skip/retry."""
    if not _active():
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_tensor_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def all_ranks(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on all of them."""
    return not any_rank(not flag)


_main_calls = [0]  # run_on_main calls so far; the same sequence on every rank


def _default_store() -> dist.Store | None:
    """The group's key-value store (private in torch, so optional: None if it moves)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # pragma: no cover - depends on the torch version
        return None


def run_on_main(fn: Callable[..., T], *args: Any, wait_s: float | None = None) -> T:
    """Run ``fn(*args)`` on rank 0 only and hand its result, or its failure, to every rank.

    Rank 0 re-raises its own exception. The other ranks raise an ``MDTrainError`` carrying rank
    0's message, so the whole job stops with rank 0's error instead of ranks 1..N-1 waiting in a
    collective that never comes. The result must pickle (failing to pickle is reported the same
    way). Keyword arguments: use ``functools.partial``.

    Rank 0's work may take longer than the collective timeout (a large neighbour statistic):
    the other ranks first wait on a key in the group's store, for ``wait_s`` seconds (None: no
    limit), and only then enter the broadcast. If rank 0 dies, the store or the broadcast
    fails and they raise too.
    """
    if not _active():
        return fn(*args)
    _main_calls[0] += 1
    key = f"mdtrain/run_on_main/{_main_calls[0]}"
    store = _default_store()
    if get_rank() == 0:
        try:
            result = fn(*args)
            payload: tuple = ("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException as exc:
            try:
                _publish(
                    store,
                    key,
                    ("error", type(exc).__name__, str(exc), isinstance(exc, MDTrainError)),
                )
            except Exception as send_exc:  # keep rank 0's own error, the one that matters
                log.debug("could not send rank 0's failure to the other ranks: %s", send_exc)
            raise
        _publish(store, key, payload)
        return result
    try:
        if store is not None:
            store.wait(
                [key],
                datetime.timedelta(seconds=wait_s if wait_s is not None else 10 * 365 * 86400),
            )
        message = broadcast_object(None)
    except (RuntimeError, OSError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MDTrainError(
            f"lost contact with rank 0 while waiting for its result: {text}"
        ) from exc
    if message[0] == "ok":
        return pickle.loads(message[1])
    _, type_name, text, user_error = message
    if user_error:
        raise MDTrainError(f"rank 0: {text}")
    raise MDTrainError(f"rank 0 failed with {type_name}: {text}")


def _publish(store: dist.Store | None, key: str, payload: tuple) -> None:
    if store is not None:
        store.set(key, b"1")
    broadcast_object(payload)


# --------------------------------------------------------------------------- gradients


def wrap_ddp(model: torch.nn.Module, runtime: Runtime, **ddp_kwargs: Any) -> torch.nn.Module:
    """DistributedDataParallel for N > 1 (``device_ids`` only for a CUDA module), the model
    itself for a world of 1. The constructor broadcasts rank 0's parameters and buffers."""
    if runtime.world_size == 1 or not _active():
        return model
    from torch.nn.parallel import DistributedDataParallel

    if runtime.device.type == "cuda":
        return DistributedDataParallel(
            model,
            device_ids=[runtime.device.index],
            output_device=runtime.device.index,
            **ddp_kwargs,
        )
    return DistributedDataParallel(model, device_ids=None, output_device=None, **ddp_kwargs)


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (for manual gradient averaging,
    where no DDP constructor does it)."""
    if not _active():
        return
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if not _needs_move(tensor):
                dist.broadcast(tensor.data, src=src)
            else:
                moved = tensor.data.to(_tensor_device())
                dist.broadcast(moved, src=src)
                tensor.data.copy_(moved)


def all_reduce_gradients(
    params: Iterable[torch.nn.Parameter], world_size: int | None = None, bucket_mb: float = 25.0
) -> None:
    """Average ``.grad`` over ranks with few flattened all-reduces (buckets per dtype/device).

    A parameter that needs a gradient but has none gets zeros, so every rank builds the same
    buckets (a rank whose batch missed a parameter must still take part). For micro-batch
    accumulation call it once, after the last backward.
    """
    world = get_world_size() if world_size is None else world_size
    if world == 1 or not _active():
        return
    grads: list[torch.Tensor] = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    limit = max(int(bucket_mb * 2**20), 1)
    buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for g in grads:
        key = (g.dtype, g.device)
        groups = buckets.setdefault(key, [[]])
        nbytes = g.numel() * g.element_size()
        if groups[-1] and sizes.get(key, 0) + nbytes > limit:
            groups.append([])
            sizes[key] = 0
        groups[-1].append(g)
        sizes[key] = sizes.get(key, 0) + nbytes
    for groups in buckets.values():
        for bucket in groups:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            all_reduce_sum(flat)
            flat /= world
            offset = 0
            for g in bucket:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
