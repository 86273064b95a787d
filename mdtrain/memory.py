"""Memory, shared by training, inference and statistics: recognise every form of out-of-memory
error PyTorch raises, release memory, inject simulated failures for debugging, chunk inference
work so it backs off instead of crashing, and keep freed memory in the process.

It sits below the model, inference, data and training packages (it imports only the standard
library, torch and ``mdtrain.errors``), so any of them can back off from an allocation failure
without importing the training package.

PyTorch reports an allocation failure in many shapes (a dedicated exception type, a plain
RuntimeError whose text depends on the library that failed, TorchScript and AOTInductor
wrappers that re-raise it with a different layout, or chained under another exception).
Missing one form means a run crashes where it could have recovered, so every form is listed
here, in one place, and tested.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mdtrain.errors import MDTrainError

# the benchmarks import it from here: they also time trees from before heap.py
from mdtrain.heap import keep_freed_memory  # noqa: F401

log = logging.getLogger("mdtrain.memory")

T = TypeVar("T")

#: Texts that mark an allocation failure inside a RuntimeError (case-sensitive, as printed).
OOM_TEXTS: tuple[str, ...] = (
    "CUDA out of memory.",
    "CUDA driver error: out of memory",
    "CUDA error: out of memory",
    "cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "HIP out of memory.",
    "MPS backend out of memory",
    "XPU out of memory.",
    "std::bad_alloc",  # a C++ allocation failure re-raised as text (extensions, TorchScript)
    "CUDNN_STATUS_ALLOC_FAILED",
)

#: cuBLAS reports a failed handle creation (it allocates the handle's workspace) as "not
#: initialized": an allocation failure when it comes from ``cublasCreate``, not otherwise.
CUBLAS_CREATE_TEXTS: tuple[str, ...] = ("CUBLAS_STATUS_NOT_INITIALIZED", "cublasCreate")

#: AOTInductor re-wraps the failure of a compiled model: both texts appear in its message.
AOTI_WRAPPER_TEXTS: tuple[str, ...] = ("run_func_(", "model_container_runner")

SIMULATE_ATOMS_ENV = "MDTRAIN_SIMULATE_OOM_ATOMS"
SIMULATE_RANKS_ENV = "MDTRAIN_SIMULATE_OOM_RANKS"
INFER_BATCH_ENV = "MDTRAIN_INFER_BATCH_SIZE"
INFER_BATCH_ENV_COMPAT = "DP_INFER_BATCH_SIZE"

_MESSAGE_TYPES: tuple[type[BaseException], ...] = (RuntimeError, torch.jit.Error)


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not hide the original error
        return ""


def _is_oom_alone(exc: BaseException) -> bool:
    """Whether this one exception, ignoring its chain, reports an allocation failure."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(exc, _MESSAGE_TYPES):
        return False
    text = _message(exc)
    if any(t in text for t in OOM_TEXTS):
        return True
    return all(t in text for t in CUBLAS_CREATE_TEXTS) or all(t in text for t in AOTI_WRAPPER_TEXTS)


def is_oom_error(exc: BaseException) -> bool:
    """True if ``exc`` or an exception it was raised from (``__cause__``) or while handling
    (``__context__``, unless suppressed with ``from None``) is an out-of-memory error.

    MDTrainError (a final verdict, e.g. "a single frame does not fit") and exceptions that are
    not ``Exception`` (KeyboardInterrupt, SystemExit) are never treated as OOM, even when raised
    while handling one.
    """
    if isinstance(exc, MDTrainError) or not isinstance(exc, Exception):
        return False
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if _is_oom_alone(e):
            return True
        if e.__cause__ is not None:
            todo.append(e.__cause__)
        if e.__context__ is not None and not e.__suppress_context__:
            todo.append(e.__context__)
    return False


def oom_site(exc: BaseException) -> str:
    """Where an out-of-memory error happened, for the log: the innermost mdtrain source line
    of its traceback and the first line of its message (``"fitting_node.py:71: ..."``)."""
    site = ""
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if f"{os.sep}mdtrain{os.sep}" in filename:
            site = f"{os.path.basename(filename)}:{tb.tb_lineno}"
        tb = tb.tb_next
    first = (_message(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    return f"{site}: {first}" if site else first


def release_memory() -> None:
    """Free what an aborted attempt left behind: Python cycles first, then the CUDA cache."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _env_positive_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise MDTrainError(f"environment variable {name}={value!r} must be a positive integer")
    return number


def _env_ranks(name: str) -> set[int] | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return {int(part) for part in value.split(",") if part.strip()}
    except ValueError:
        raise MDTrainError(
            f"environment variable {name}={value!r} must be a comma-separated list of ranks"
        ) from None


def _current_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def simulated_oom(message: str) -> RuntimeError:
    """The exception a real CUDA allocation failure would raise, carrying ``message``."""
    try:
        return torch.OutOfMemoryError(message)
    except Exception:  # very old builds cannot construct it from Python
        return RuntimeError(message)


def maybe_simulate_oom(natoms_in_batch: int, rank: int | None = None) -> None:
    """Raise a simulated OOM when ``MDTRAIN_SIMULATE_OOM_ATOMS=N`` is set and the batch holds
    more than N atoms (on the ranks listed in ``MDTRAIN_SIMULATE_OOM_RANKS``, default all).

    Called at the start of each forward so the recovery paths can be exercised on any machine.
    The environment is read at every call (a dictionary look-up) so tests can change it.
    ``rank`` defaults to the process-group rank, else ``$RANK``, else 0.
    """
    limit = _env_positive_int(SIMULATE_ATOMS_ENV)
    if limit is None or natoms_in_batch <= limit:
        return
    ranks = _env_ranks(SIMULATE_RANKS_ENV)
    if ranks is not None:
        if rank is None:
            rank = _current_rank()
        if rank not in ranks:
            return
    raise simulated_oom(
        f"CUDA out of memory. (simulated by {SIMULATE_ATOMS_ENV}={limit}: "
        f"batch of {natoms_in_batch} atoms)"
    )


# On a CPU chunks stay at this many atoms unless the environment sets a bound: a 192-atom water
# frame already fills the cores, and larger chunks only spill the caches (8192 atoms took twice
# the time of 1024 in `mdtrain test` on water, and 4 GB instead of 0.8) and invite the kernel's
# OOM killer, which Python cannot catch.
CPU_MAX_ATOMS = 1024


class InferenceChunker:
    """Run work over items in chunks whose size (in atoms) adapts to the memory available.

    Used where the result does not depend on the chunking (inference, statistics, neighbour
    statistics). The size starts at ``start_atoms`` (default ``$MDTRAIN_INFER_BATCH_SIZE``, else
    ``$DP_INFER_BATCH_SIZE``, else 1024), doubles after a full chunk succeeds, never exceeds
    ``max_atoms`` (default: the environment value when set; otherwise ``CPU_MAX_ATOMS`` on CPU,
    so no growth there, and unbounded on accelerators),
    and never returns to a size that failed. On OOM it halves and retries the same chunk.
    The learned size is kept across calls.
    """

    def __init__(
        self,
        start_atoms: int | None = None,
        max_atoms: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        env = _env_positive_int(INFER_BATCH_ENV) or _env_positive_int(INFER_BATCH_ENV_COMPAT)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        on_cpu = torch.device(device).type == "cpu"
        if max_atoms is None:
            max_atoms = env if env is not None else (CPU_MAX_ATOMS if on_cpu else 2**31)
        if start_atoms is None:
            start_atoms = env if env is not None else 1024
        if start_atoms <= 0 or max_atoms <= 0:
            raise ValueError("start_atoms and max_atoms must be positive")
        self.max_atoms = max_atoms
        self.current = min(start_atoms, max_atoms)
        self.min_failed = 2**62  # smallest chunk (in atoms) known to fail
        self.oom_count = 0

    def chunk_items(self, natoms_per_item: int) -> int:
        """Items per chunk at the current size (at least one)."""
        return max(self.current // natoms_per_item, 1)

    def run_all(
        self,
        fn: Callable[[int, int], T],
        nitems: int,
        natoms_per_item: int,
        name: str = "",
    ) -> list[T]:
        """Call ``fn(start, stop)`` over consecutive chunks covering ``range(nitems)`` and
        return the results in order. ``name`` (a system path) only labels the error raised
        when a single item does not fit."""
        if natoms_per_item <= 0:
            raise ValueError("natoms_per_item must be positive")
        results: list[T] = []
        start = 0
        while start < nitems:
            count = min(self.chunk_items(natoms_per_item), nitems - start)
            ok, value = self._try(fn, start, start + count)
            if ok:
                results.append(value)
                start += count
                self._maybe_grow(count * natoms_per_item, natoms_per_item)
                continue
            self._shrink(count, natoms_per_item, name)
        return results

    def _try(self, fn: Callable[[int, int], T], start: int, stop: int) -> tuple[bool, Any]:
        try:
            return True, fn(start, stop)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            log.info("out of memory at %s", oom_site(exc))
        # outside the handler, so the failed attempt's frames and tensors are gone
        release_memory()
        return False, None

    def _maybe_grow(self, used_atoms: int, natoms_per_item: int) -> None:
        if used_atoms + natoms_per_item <= self.current:
            return  # the chunk was not full (last chunk), so it says nothing about the limit
        bigger = min(2 * self.current, self.max_atoms)
        if self.current < bigger < self.min_failed:
            log.debug("inference chunk grows to %d atoms", bigger)
            self.current = bigger

    def _shrink(self, count: int, natoms_per_item: int, name: str) -> None:
        self.oom_count += 1
        tried = count * natoms_per_item
        self.min_failed = min(self.min_failed, tried)
        if count == 1:
            where = f"system {name}: " if name else ""
            raise MDTrainError(
                f"{where}a single frame of {natoms_per_item} atoms does not fit in memory "
                "during inference; use a device with more memory"
            )
        self.current = max(tried // 2, 1)
        log.info("out of memory on a chunk of %d atoms; retrying with %d", tried, self.current)
