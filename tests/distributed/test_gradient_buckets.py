"""Gradient averaging over preallocated buckets: the same averages as flattening per call, and
no allocation at step time (an allocation failure there would strike one rank on its way into
a collective)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mdtrain.distributed import GradientBuckets


class Allocations(TorchDispatchMode):
    """Names of the operations that return a tensor of fresh storage."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if "out" in (kwargs or {}):
            inputs.add(kwargs["out"].untyped_storage().data_ptr())
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:
            self.seen.append(func.__name__)
        return out


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(300, 200), (200,), (50, 3), (7,)]
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes
    ]
    params.append(torch.nn.Parameter(torch.ones(4, dtype=torch.float32)))  # another dtype
    params.append(torch.nn.Parameter(torch.ones(3), requires_grad=False))
    for p in params[:-1]:
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
    return params


def test_buckets_split_by_size_and_dtype_in_parameter_order():
    params = _params()
    buckets = GradientBuckets(params, bucket_mb=0.4)  # 480 kB: the first matrix alone
    shapes = [[tuple(p.shape) for p in b] for b in buckets.buckets]
    assert shapes == [[(300, 200)], [(200,), (50, 3), (7,)], [(4,)]]
    assert [f.dtype for f in buckets.flats] == [torch.float64, torch.float64, torch.float32]


def test_averaging_allocates_nothing_and_fills_missing_gradients_once():
    params = _params()
    expected = [p.grad / 4 for p in params[:-1]]
    buckets = GradientBuckets(params, bucket_mb=0.4)
    with Allocations() as allocations:
        buckets.all_reduce(4)  # outside a process group: the sum over one rank
    assert allocations.seen == []
    for p, want in zip(params[:-1], expected, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0)
    params[1].grad = None  # a parameter this rank's batch did not reach
    buckets.all_reduce(1)
    assert torch.equal(params[1].grad, torch.zeros(200, dtype=torch.float64))
