"""Gradient averaging over preallocated buckets: the same averages as flattening per call, no
allocation at step time (an allocation failure there would strike one rank on its way into a
collective), and the overlapped protocol: buckets in the order the backward fills them,
launched in order, once per round, by the step's last backward only."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mdtrain.distributed import GradientBuckets
from mdtrain.errors import MDTrainError
from mdtrain.model.backend import build_model
from tests.helpers.models import batch, set_random_stats, small_config


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


def test_buckets_split_by_size_and_dtype_in_reverse_parameter_order():
    params = _params()
    buckets = GradientBuckets(params, bucket_mb=0.4)  # 480 kB: the large matrix alone
    shapes = [[tuple(p.shape) for p in b] for b in buckets.buckets]
    assert shapes == [[(4,)], [(7,), (50, 3), (200,)], [(300, 200)]]
    assert [f.dtype for f in buckets.flats] == [torch.float32, torch.float64, torch.float64]


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


ONE_PARAM = 8 / 2**20  # bucket_mb of one float64 number: a bucket per parameter tensor


def _chain(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
        torch.nn.Linear(8, 1),
    ).double()  # fmt: skip


def _chain_loss(model: torch.nn.Module, seed: int = 1) -> torch.Tensor:
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (model(x) ** 2).sum()


def test_hooks_launch_only_inside_launching_in_order_once_per_round():
    model = _chain()
    seen: list[int] = []
    first = model[0].weight  # its gradient comes last: by then the later layers' launched
    first.register_post_accumulate_grad_hook(lambda _: seen.append(buckets.launches))
    buckets = GradientBuckets(model.parameters(), bucket_mb=ONE_PARAM, overlap=True)
    assert len(buckets.buckets) == 6  # a bucket per weight and per bias
    _chain_loss(model).backward()  # an earlier micro-batch: nothing launches
    assert buckets.launches == 0
    seen.clear()
    with buckets.launching():
        _chain_loss(model).backward()
    assert seen[0] in (4, 5) and buckets.launches == 6  # during the backward, each once
    buckets.launch_rest()  # nothing left: the round ends without another launch
    assert buckets.launches == 6
    opened = buckets.launching()
    opened.__enter__()  # a round open, as inside a backward
    with pytest.raises(RuntimeError, match="second launching"), buckets.launching():
        pass


def test_overlapped_and_after_backward_give_the_same_bits():
    grads = []
    for overlap in (True, False):
        model = _chain()
        buckets = GradientBuckets(model.parameters(), bucket_mb=ONE_PARAM, overlap=overlap)
        _chain_loss(model, seed=2).backward()
        with buckets.launching() if overlap else contextlib.nullcontext():
            _chain_loss(model, seed=3).backward()
        if overlap:
            buckets.launch_rest()
            buckets.finish(3)
        else:
            buckets.all_reduce(3)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
        assert a.abs().max() > 0


def test_a_failed_backward_is_completed_by_launch_rest_and_dropped_by_the_next_round():
    model = _chain()
    buckets = GradientBuckets(model.parameters(), bucket_mb=ONE_PARAM, overlap=True)

    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            raise torch.OutOfMemoryError("CUDA out of memory. (test)")

    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(torch.OutOfMemoryError), buckets.launching():
        (model[4](Fail.apply(model[3](model[2](model[1](model[0](x)))))) ** 2).sum().backward()
    assert buckets.launches in (1, 2)  # the last layer's gradients came before the failure
    buckets.launch_rest()  # the rest, with zeros where no gradient came
    assert buckets.launches == 6
    model.zero_grad(set_to_none=True)
    with buckets.launching():  # the retry: a new round, every bucket once more
        _chain_loss(model).backward()
    buckets.launch_rest()
    buckets.finish(1)
    assert buckets.launches == 12
    expected = _chain()
    _chain_loss(expected).backward()
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("one_side", [True, False])
@pytest.mark.parametrize("backend", ["kernels", "fused", "reference"])
def test_backends_fill_buckets_in_reverse_parameter_order(backend, one_side):
    """The order the buckets follow, measured: each backward produces the fitting nets'
    gradients (on the accelerated backends all types' from one node) before the embedding
    nets', so the fitting buckets, almost all of the bytes, launch while the embedding
    backward still runs."""
    try:
        model = build_model(small_config({"type_one_side": one_side}), backend=backend)
    except MDTrainError as exc:
        pytest.skip(f"backend {backend} cannot run here: {exc}")
    set_random_stats(model).train()
    names = {p: n for n, p in model.named_parameters()}
    order: list[str] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda t: order.append(names[t]))
    out = model(*batch(model))
    (out["energy"].sum() + (out["force"] ** 2).sum()).backward()
    assert sorted(order) == sorted(names.values())  # every gradient, once
    nets = list(dict.fromkeys(n.rsplit(".layers.", 1)[0] for n in order))
    ntypes = len(model.get_model_config()["type_map"])
    assert sorted(nets[:ntypes]) == [f"fitting.networks.{t}" for t in range(ntypes)]
    assert all(n.startswith("descriptor.") for n in nets[ntypes:]), nets
