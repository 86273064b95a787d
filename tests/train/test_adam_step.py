"""The fused Adam kernel called directly (`AdamSteps`) is each optimiser's own ``step()`` bit
for bit: weights, moments and step counts, for Adam and AdamW, one optimiser or several, in
float32 and float64, across a ``load_state_dict``; and it hands the cases it does not cover
to torch's own step."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from mdtrain.train import adam_step
from mdtrain.train.adam_step import AdamSteps
from mdtrain.train.optimizer import make_adam, reserve_state

SHAPES = [(5, 3), (7,), (2, 2, 2), (40, 30)]


def _setup(count: int, dtype: torch.dtype, seed: int = 0, **settings) -> list:
    gen = torch.Generator().manual_seed(seed)
    optimisers = []
    for _ in range(count):
        params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in SHAPES]
        opt = make_adam(params, 1e-2, **settings)
        reserve_state(opt)
        optimisers.append(opt)
    return optimisers


def _params(optimisers: list) -> list[torch.Tensor]:
    return [p for opt in optimisers for g in opt.param_groups for p in g["params"]]


def _grads(optimisers_pair: list[list], gen: torch.Generator) -> None:
    first, second = (_params(opts) for opts in optimisers_pair)
    for a, b in zip(first, second, strict=True):
        a.grad = torch.randn(a.shape, generator=gen, dtype=a.dtype)
        b.grad = a.grad.clone()


def _assert_same(reference: list, fused: list) -> None:
    for ref, new in zip(reference, fused, strict=True):
        for pa, pb in zip(_params([ref]), _params([new]), strict=True):
            assert torch.equal(pa, pb)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(ref.state[pa][key], new.state[pb][key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize(
    "settings", [{}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "decoupled": True}]
)
def test_direct_kernel_equals_torch_step_bit_for_bit(dtype, count, settings, monkeypatch):
    reference, fused = _setup(count, dtype, **settings), _setup(count, dtype, **settings)
    fallbacks = []
    monkeypatch.setattr(adam_step, "step_together", lambda opts: fallbacks.append(opts))
    steps = AdamSteps(fused)
    gen = torch.Generator().manual_seed(1)
    for i in range(5):
        _grads([reference, fused], gen)
        for opt in [*reference, *fused]:
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (i + 1)  # the schedule changes it at every step
        for opt in reference:
            opt.step()
        steps.step()
    assert not fallbacks  # the direct path took every step
    _assert_same(reference, fused)
    assert not torch.equal(_params(fused)[0], _params(_setup(count, dtype))[0])  # they moved
    assert float(fused[0].state[_params(fused)[0]]["step"]) == 5


def test_gathers_again_after_load_state_dict():
    reference, fused = _setup(2, torch.float64), _setup(2, torch.float64)
    steps = AdamSteps(fused)
    gen = torch.Generator().manual_seed(2)
    _grads([reference, fused], gen)
    for opt in reference:
        opt.step()
    steps.step()
    saved = [copy.deepcopy(opt.state_dict()) for opt in reference]
    written = []
    for opt in fused:  # a checkpoint's round trip: the shared step counts as they are saved
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        written.append(torch.load(buffer))
    for opt in reference:  # a step that the loads below undo in both
        opt.step()
    steps.step()
    for opts, states in ((reference, saved), (fused, written)):
        for opt, state in zip(opts, states, strict=True):
            opt.load_state_dict(state)
    for _ in range(2):
        _grads([reference, fused], gen)
        for opt in reference:
            opt.step()
        steps.step()
    _assert_same(reference, fused)
    assert float(fused[1].state[_params([fused[1]])[0]]["step"]) == 3


def test_hands_uncovered_cases_to_torch_step():
    reference, fused = _setup(2, torch.float64), _setup(2, torch.float64)
    steps = AdamSteps(fused)
    gen = torch.Generator().manual_seed(3)
    for opts in (reference, fused):
        opts[1].param_groups[0]["eps"] = 1e-6  # settings that differ: torch's steps
    for _ in range(2):
        _grads([reference, fused], gen)
        for opt in reference:
            opt.step()
        steps.step()
    for opts in (reference, fused):
        opts[1].param_groups[0]["eps"] = 1e-8
    _grads([reference, fused], gen)
    for opt in reference:
        opt.step()
    steps.step()  # covered: the direct path (its step counts shared in one vector)
    _grads([reference, fused], gen)
    _params(reference)[1].grad = _params(fused)[1].grad = None  # a parameter without gradient
    for opt in reference:
        opt.step()
    steps.step()  # torch's step again, over the shared counts: each advanced once
    _assert_same(reference, fused)
    assert float(fused[0].state[_params(fused)[1]]["step"]) == 3  # skipped once
    lazy_ref = [make_adam([torch.nn.Parameter(torch.ones(3))], 1e-2)]  # no state yet
    lazy = [make_adam([torch.nn.Parameter(torch.ones(3))], 1e-2)]
    lazy_steps = AdamSteps(lazy)
    for _ in range(2):
        _grads([lazy_ref, lazy], gen)
        lazy_ref[0].step()
        lazy_steps.step()
    _assert_same(lazy_ref, lazy)
