"""Keeping the model in step across ranks: the DDP wrapper, a parameter broadcast, and
bucketed gradient averaging for training without DDP. Separate from the small collectives
because these work on a whole module's tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mdtrain.distributed.collectives import (
    all_reduce_sum,
    collective_device,
    get_world_size,
    group_active,
    needs_move,
)
from mdtrain.distributed.runtime import Runtime


def wrap_ddp(model: torch.nn.Module, runtime: Runtime, **ddp_kwargs: Any) -> torch.nn.Module:
    """DistributedDataParallel for N > 1 (``device_ids`` only for a CUDA module), the model
    itself for a world of 1. The constructor broadcasts rank 0's parameters and buffers."""
    if runtime.world_size == 1 or not group_active():
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
    if not group_active():
        return
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if not needs_move(tensor):
                dist.broadcast(tensor.data, src=src)
            else:
                moved = tensor.data.to(collective_device())
                dist.broadcast(moved, src=src)
                tensor.data.copy_(moved)


DEFAULT_BUCKET_MB = 2.0  # training.distributed.bucket_mb's default


class GradientBuckets:
    """Flat buffers for averaging gradients over ranks, allocated once, before training: a
    step then allocates nothing to communicate, so an allocation failure cannot strike one
    rank on its way into a collective the others are already waiting in.

    Buckets of at most ``bucket_mb`` per dtype and device, in *reverse* parameter order: the
    order in which a backward produces the gradients (measured on the kernels, fused and
    reference backends: the fitting nets, last type first on the reference backend, all
    types' from one node on the others, then the embedding nets; within a net the order
    differs between backends, but a net's gradients arrive together).

    Two uses, with the same collectives on the same buffers, so the same averages bit for bit:

    - ``all_reduce(world)`` after the backward;
    - with ``overlap=True``, hooks on the parameters launch each bucket's all-reduce
      asynchronously as soon as its gradients are ready, inside a backward run under
      ``launching()`` (only the step's last micro-batch: the gradients are complete then).
      ``launch_rest()`` launches what that backward did not (parameters that got no gradient,
      a backward that failed, a rank that ran none in this attempt) and ends the *round*;
      ``finish(world)`` waits and writes the averages. Buckets launch strictly in order, each
      once per round, so every rank issues the same collectives in the same order whatever
      order its hooks fire in. The gradients are not touched before ``finish``: a round whose
      attempt is voted down (an out-of-memory retry) is waited for and dropped, and the next
      round sends again from the gradients, kept or recomputed.

    A parameter without a gradient contributes zeros; after ``finish`` its ``.grad`` is a view
    of the bucket (no allocation), valid until the next ``zero_grad(set_to_none=True)``.
    """

    _IDLE, _OPEN, _LAUNCHED = "idle", "open", "launched"

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        bucket_mb: float = DEFAULT_BUCKET_MB,
        overlap: bool = False,
    ) -> None:
        limit = max(int(bucket_mb * 2**20), 1)
        self.buckets: list[list[torch.nn.Parameter]] = []
        open_bucket: dict[tuple[torch.dtype, torch.device], int] = {}  # key -> bucket index
        sizes: dict[int, int] = {}
        for p in reversed([p for p in params if p.requires_grad]):
            key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
            index = open_bucket.get(key)
            if index is None or (self.buckets[index] and sizes[index] + nbytes > limit):
                index = open_bucket[key] = len(self.buckets)
                self.buckets.append([])
                sizes[index] = 0
            self.buckets[index].append(p)
            sizes[index] += nbytes
        self.flats = [
            torch.empty(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
            for b in self.buckets
        ]
        self._views: list[list[torch.Tensor]] = []  # each parameter's place in its flat
        for bucket, flat in zip(self.buckets, self.flats, strict=True):
            views, offset = [], 0
            for p in bucket:
                views.append(flat[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
            self._views.append(views)
        self._state = self._IDLE
        self._armed = False
        self._next = 0  # the next bucket to launch in this round
        self._ready = [[False] * len(b) for b in self.buckets]  # per parameter, this round
        self._missing = [len(b) for b in self.buckets]  # parameters not ready, this round
        self._handles: list[Any] = [None] * len(self.buckets)
        self.launches = 0  # bucket all-reduces started so far (for tests and benchmarks)
        self._hooks = []
        if overlap:
            for i, bucket in enumerate(self.buckets):
                for j, p in enumerate(bucket):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i, j)))

    # ------------------------------------------------------------------ after the backward

    def all_reduce(self, world: int) -> None:
        """Average every ``.grad`` over the ``world`` ranks, all buckets after the backward."""
        self.launch_rest()
        self.finish(world)

    # ------------------------------------------------------------------ overlapped

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """Run the step's last backward in this block: its hooks launch the buckets as their
        gradients complete. Opens a round (after waiting for a dropped round's all-reduces,
        whose buffers are about to be refilled); a round already open is a caller's error."""
        if self._state == self._OPEN:
            raise RuntimeError("GradientBuckets: a second launching backward in one round")
        self._open_round()
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def launch_rest(self) -> None:
        """Launch, in order, every bucket this round has not launched (zeros for gradients
        that never came), which ends the round. Every rank calls it once per attempt, before
        the attempt's vote, whether its backward ran, failed or finished."""
        if self._state != self._OPEN:
            self._open_round()
        while self._next < len(self.buckets):
            self._launch()
        self._state = self._LAUNCHED

    def finish(self, world: int) -> None:
        """Wait for the round's all-reduces and write the averages into the ``.grad``."""
        if self._state != self._LAUNCHED:
            raise RuntimeError("GradientBuckets.finish: the round is not fully launched")
        self._wait()
        for bucket, flat, views in zip(self.buckets, self.flats, self._views, strict=True):
            flat /= world
            for p, view in zip(bucket, views, strict=True):
                if p.grad is None:
                    p.grad = view  # zeros from this rank: no allocation
                elif p.grad.data_ptr() != view.data_ptr():
                    p.grad.copy_(view)
        self._state = self._IDLE

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------------ internals

    def _hook(self, i: int, j: int) -> Callable[[torch.Tensor], None]:
        def ready(_: torch.Tensor) -> None:
            if not self._armed or self._ready[i][j]:
                return
            self._ready[i][j] = True
            self._missing[i] -= 1
            while self._next < len(self.buckets) and self._missing[self._next] == 0:
                self._launch()

        return ready

    def _open_round(self) -> None:
        self._wait()  # a dropped round's all-reduces still read the buffers
        self._next = 0
        for i, flags in enumerate(self._ready):
            flags[:] = [False] * len(flags)
            self._missing[i] = len(flags)
        self._state = self._OPEN

    def _launch(self) -> None:
        i = self._next
        for p, view in zip(self.buckets[i], self._views[i], strict=True):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
        flat = self.flats[i]
        if group_active():
            if needs_move(flat):  # a CPU gradient under pure NCCL: through the GPU, at once
                all_reduce_sum(flat)
            else:
                self._handles[i] = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        self._next += 1
        self.launches += 1

    def _wait(self) -> None:
        for i, handle in enumerate(self._handles):
            if handle is not None:
                self._handles[i] = None
                handle.wait()


def all_reduce_gradients(
    params: Iterable[torch.nn.Parameter],
    world_size: int | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> None:
    """Average ``.grad`` over ranks with few flattened all-reduces (``GradientBuckets`` made
    for this one call; a training loop keeps one instead). For micro-batch accumulation call
    it once, after the last backward."""
    world = get_world_size() if world_size is None else world_size
    if world == 1 or not group_active():
        return
    GradientBuckets(params, bucket_mb).all_reduce(world)
