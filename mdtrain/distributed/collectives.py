"""The few collectives the trainer needs (rank and world, barrier, object broadcast, sums,
minima and maxima, any/all flags), and ``run_on_main``, which broadcasts rank 0's result *or its failure*.

Every helper works in a world of 1 too (it just does the local thing), so callers have one
code path for 1 and N processes.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mdtrain.distributed.failures import PeerFailure
from mdtrain.errors import MDTrainError

log = logging.getLogger("mdtrain.distributed")
T = TypeVar("T")


def group_active() -> bool:
    """Whether a process group of more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank (0 outside a process group)."""
    return dist.get_rank() if group_active() else 0


def get_world_size() -> int:
    """The number of processes (1 outside a process group)."""
    return dist.get_world_size() if group_active() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def _cpu_collectives() -> bool:
    """Whether the group moves CPU tensors (Gloo, MPI, or the Gloo half of "cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend()).lower()
    return "gloo" in backend or "mpi" in backend


def collective_device() -> torch.device:
    """Where small flag tensors go: the CPU unless the group can only move CUDA tensors."""
    if _cpu_collectives():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def needs_move(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` must go to ``collective_device()`` before a collective."""
    return tensor.device.type == "cpu" and not _cpu_collectives()


def barrier() -> None:
    """Wait for every rank (no-op in a world of 1)."""
    if group_active():
        dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (pickled; keep it modest in size)."""
    if not group_active():
        return obj
    box = [obj if get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]  # type: ignore[return-value]


def broadcast_tensor(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Rank ``src``'s ``tensor`` copied into ``tensor`` on every rank, in place."""
    if not group_active():
        return tensor
    if not needs_move(tensor):
        dist.broadcast(tensor, src=src)
        return tensor
    moved = tensor.to(collective_device())
    dist.broadcast(moved, src=src)
    tensor.copy_(moved)
    return tensor


def gather_to_main(obj: T) -> list[T] | None:
    """Every rank's ``obj`` (pickled) in rank order on rank 0, None on the others."""
    if not group_active():
        return [obj]
    out: list | None = [None] * get_world_size() if get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """Reduce ``tensor`` over ranks in place and return it (copies through the group's device
    if the tensor lives elsewhere, e.g. a CPU tensor under pure NCCL)."""
    if not group_active():
        return tensor
    if not needs_move(tensor):
        dist.all_reduce(tensor, op=op)
        return tensor
    moved = tensor.to(collective_device())
    dist.all_reduce(moved, op=op)
    tensor.copy_(moved)
    return tensor


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place and return it."""
    return _all_reduce(tensor, dist.ReduceOp.SUM)


def all_reduce_min(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise minimum over ranks, in place (exact: no rounding)."""
    return _all_reduce(tensor, dist.ReduceOp.MIN)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum over ranks, in place (exact: no rounding)."""
    return _all_reduce(tensor, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one: collective stop/skip/retry."""
    if not group_active():
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def raise_together(error: BaseException | None, elsewhere: str) -> None:
    """Every rank raises when one of them failed (a collective, on every rank): its own
    ``error``, or an ``MDTrainError`` saying ``elsewhere`` on the ranks that did not fail."""
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise MDTrainError(elsewhere)


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

    Rank 0 re-raises its own exception. The other ranks raise a ``PeerFailure`` (an ``MDTrainError``) carrying rank
    0's message, so the whole job stops with rank 0's error instead of ranks 1..N-1 waiting in a
    collective that never comes. The result must pickle (failing to pickle is reported the same
    way). Keyword arguments: use ``functools.partial``.

    Rank 0's work may take longer than the collective timeout (a large neighbour statistic):
    the other ranks first wait on a key in the group's store, for ``wait_s`` seconds (None: no
    limit), and only then enter the broadcast. If rank 0 dies, the store or the broadcast
    fails and they raise too.
    """
    if not group_active():
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
        raise PeerFailure(
            f"lost contact with rank 0 while waiting for its result: {text}", 0
        ) from exc
    if message[0] == "ok":
        return pickle.loads(message[1])
    _, type_name, text, user_error = message
    if user_error:
        raise PeerFailure(f"rank 0: {text}", 0, quotes=True)
    raise PeerFailure(f"rank 0 failed with {type_name}: {text}", 0, quotes=True)


def _publish(store: dist.Store | None, key: str, payload: tuple) -> None:
    if store is not None:
        store.set(key, b"1")
    broadcast_object(payload)
