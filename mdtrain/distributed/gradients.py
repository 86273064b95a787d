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


def all_reduce_gradients(
    params: Iterable[torch.nn.Parameter], world_size: int | None = None, bucket_mb: float = 25.0
) -> None:
    """Average ``.grad`` over ranks with few flattened all-reduces (buckets per dtype/device).

    A parameter that needs a gradient but has none gets zeros, so every rank builds the same
    buckets (a rank whose batch missed a parameter must still take part). For micro-batch
    accumulation call it once, after the last backward.
    """
    world = get_world_size() if world_size is None else world_size
    if world == 1 or not group_active():
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
