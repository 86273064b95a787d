"""Setting up the run: ``init_distributed`` detects the launcher, sets logging and the device,
picks the backend and forms the process group (N > 1); ``Runtime`` records the result and
destroys the group on exit.

The one place that creates or destroys the process group; the other modules of
``mdtrain.distributed`` each answer one question for it or work inside the group it made.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mdtrain.distributed.backend import choose_backend
from mdtrain.distributed.device import select_device
from mdtrain.distributed.launch import LaunchEnv, detect_launch_env
from mdtrain.errors import MDTrainError
from mdtrain.log import setup_logging

log = logging.getLogger("mdtrain.distributed")


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
