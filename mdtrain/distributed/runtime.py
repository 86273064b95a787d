"""Setting up the run: ``init_distributed`` detects the launcher, sets logging and the device,
picks the backend and forms the process group (N > 1); ``Runtime`` records the result and, as
a context manager, ends every rank when one fails (``failures``) and destroys the group.

The one place that creates or destroys the process group; the other modules of
``mdtrain.distributed`` each answer one question for it or work inside the group it made.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mdtrain.distributed.backend import choose_backend, resolve_backend_request
from mdtrain.distributed.device import select_device
from mdtrain.distributed.failures import FailureChannel, first_line
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
    failures: FailureChannel | None = None  # None: a world of 1, or MPI (no store)

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
        """Start watching for other ranks' failures (see ``failures``)."""
        if self.failures is not None:
            self.failures.start()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """Publish this rank's failure (or recognise another's), then destroy the group.

        A clean end, ``SystemExit(0)`` included, tells the store host it may go. An error that
        only says a peer went away is replaced by the line of the rank that failed first.
        """
        replacement = None
        if self.failures is not None:
            if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
                self.failures.finish()
            else:
                replacement = self.failures.report(exc)
        self.shutdown()
        if replacement is not None:
            raise replacement from exc


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
    group is destroyed however the block ends, and an exception on any rank ends every rank
    within seconds, with that rank's message (``failures``).

    ``timeout_s`` bounds the rendezvous and every collective: when a rank dies or stalls, the
    others raise within it instead of hanging. With NCCL the group also carries Gloo for CPU
    tensors ("cpu:gloo,cuda:nccl"), so object broadcasts and flags need no GPU round trip.
    An NCCL group that does not form falls back to Gloo for ``auto`` or with ``fallback``.
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
        may_fall_back = fallback or resolve_backend_request(backend_request, None) == "auto"
        runtime.backend, runtime.failures = _init_group(
            env, backend, device, timeout_s, may_fall_back
        )
        runtime.has_group = True
        # a group (or a DDP wrapper holding it) still alive at interpreter exit can abort the
        # process; see Runtime._at_exit
        atexit.register(runtime._at_exit)
    log.debug(
        "rank %d of %d (local %d of %d) on %s, backend %s, launcher %s",
        env.rank, env.world_size, env.local_rank, env.local_world_size, device, runtime.backend,
        env.launcher,
    )  # fmt: skip
    return runtime


def _job_store(env: LaunchEnv, timeout: datetime.timedelta) -> tuple[dist.Store, bool]:
    """The job's key-value store, and whether this process serves it.

    The rendezvous of ``env://``, made here so the failure channel and the NCCL fallback can
    use it: rank 0 serves it, or torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE). Keys go
    under a per-attempt prefix: torchrun keeps one store for all attempts, and a relaunched
    rank must not read the attempt before (a dead peer's Gloo address, its failure record).
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts = env.rank == 0 and not agent
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=hosts,
        timeout=timeout,
        multi_tenant=hosts,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip() or "0"
    return dist.PrefixStore(f"mdtrain/attempt-{attempt}/", store), hosts


def _init_group(
    env: LaunchEnv, backend: str, device: torch.device, timeout_s: float, may_fall_back: bool
) -> tuple[str, FailureChannel | None]:
    """Form the group; the backend it got and its failure channel.

    An NCCL group that does not form on some rank is a job-wide decision: every rank says in
    the store how its attempt went, and either all keep NCCL, or all fall back to Gloo (with a
    warning naming the rank and its error), or all stop with that error.
    """
    if dist.is_initialized():
        raise MDTrainError("the process group already exists: init_distributed was called twice")
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"{env.launcher}, rank {env.rank} of {env.world_size}, master {env.master_addr}:{env.master_port}"
    if backend == "mpi":
        _attempt(lambda: dist.init_process_group("mpi", timeout=timeout), where, backend)
        return backend, None
    store, hosts = _attempt(lambda: _job_store(env, timeout), where, backend)
    # its connections open now, while the store's host surely lives: a connection opened
    # after the host died would retry for the whole timeout
    master = f"{env.master_addr}:{env.master_port}"
    failures = _attempt(
        lambda: FailureChannel(store, env.rank, env.world_size, hosts, master), where, backend
    )

    def form(name: str) -> None:
        spec = "cpu:gloo,cuda:nccl" if name == "nccl" and dist.is_gloo_available() else name
        dist.init_process_group(
            spec,
            store=dist.PrefixStore(f"{name}/", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )

    if backend == "nccl":
        failed = _nccl_vote(store, env, hosts, lambda: form("nccl"))
        if failed and dist.is_initialized():  # NCCL formed here but not everywhere
            dist.destroy_process_group()
        if failed and not may_fall_back:
            raise MDTrainError(f"cannot form the process group ({where}, backend nccl): {failed}")
        if failed:
            log.log(
                logging.WARNING if env.rank == 0 else logging.DEBUG,
                "backend 'nccl': the process group did not form (%s): using 'gloo'",
                failed,
            )
            backend = "gloo"
    if backend != "nccl":
        _attempt(lambda: form(backend), where, backend)
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise MDTrainError(
            f"process group disagrees with the launcher ({where}): "
            f"rank {dist.get_rank()} of {dist.get_world_size()}"
        )
    return backend, failures


def _attempt(fn, where: str, backend: str):  # noqa: ANN001, ANN202
    try:
        return fn()
    except (RuntimeError, ValueError, OSError) as exc:
        raise MDTrainError(
            f"cannot form the process group ({where}, backend {backend}): {first_line(exc)}"
        ) from exc


def _nccl_vote(store: dist.Store, env: LaunchEnv, hosts: bool, form: Callable[[], None]) -> str:
    """Try NCCL on every rank; "" if it formed everywhere, else the first failure's words.

    The store's host waits until every rank has read the outcome: it may stop right after.
    """
    try:
        form()
        outcome = ""
    except (RuntimeError, ValueError, OSError) as exc:
        outcome = first_line(exc)
    keys = [f"nccl-formed/{rank}" for rank in range(env.world_size)]
    try:
        store.set(keys[env.rank], outcome or "ok")
        store.wait(keys)
        answers = store.multi_get(keys)
        read = store.add("nccl-read", 1)
        deadline = time.monotonic() + store.timeout.total_seconds()
        while hosts and read < env.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
            read = store.add("nccl-read", 0)
    except (RuntimeError, OSError) as exc:
        return f"the ranks could not compare their NCCL groups ({first_line(exc)})"
    for rank, answer in enumerate(answers):
        if answer != b"ok":
            return f"rank {rank}: {answer.decode(errors='replace')}"
    return ""
