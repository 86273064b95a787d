"""Keeping the model in step across ranks: the DDP wrapper, a parameter broadcast, and
bucketed gradient averaging for training without DDP. Separate from the small collectives
because these work on a whole module's tensors."""

from __future__ import annotations

from collections.abc import Iterable
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


class GradientBuckets:
    """Flat buffers for averaging gradients over ranks, allocated once, before training: a
    step then allocates nothing to communicate, so an allocation failure cannot strike one
    rank on its way into a collective the others are already waiting in.

    Buckets of at most ``bucket_mb`` per dtype and device, in parameter order.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], bucket_mb: float = 25.0) -> None:
        limit = max(int(bucket_mb * 2**20), 1)
        self.buckets: list[list[torch.nn.Parameter]] = []
        open_bucket: dict[tuple[torch.dtype, torch.device], int] = {}  # key -> bucket index
        sizes: dict[int, int] = {}
        for p in params:
            if not p.requires_grad:
                continue
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

    def all_reduce(self, world: int) -> None:
        """Average every ``.grad`` over the ``world`` ranks. A parameter that needs a gradient
        but has none gets zeros, so every rank sends the same buckets (a rank whose batch
        missed a parameter must still take part)."""
        for bucket, flat in zip(self.buckets, self.flats, strict=True):
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            torch.cat([p.grad.reshape(-1) for p in bucket], out=flat)
            all_reduce_sum(flat)
            flat /= world
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n


def all_reduce_gradients(
    params: Iterable[torch.nn.Parameter], world_size: int | None = None, bucket_mb: float = 25.0
) -> None:
    """Average ``.grad`` over ranks with few flattened all-reduces (``GradientBuckets`` made
    for this one call; a training loop keeps one instead). For micro-batch accumulation call
    it once, after the last backward."""
    world = get_world_size() if world_size is None else world_size
    if world == 1 or not group_active():
        return
    GradientBuckets(params, bucket_mb).all_reduce(world)
