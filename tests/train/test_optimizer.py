"""The optimiser's state reserved before the first step changes nothing of what it computes."""

from __future__ import annotations

import torch

from mdtrain.train.optimizer import make_adam, reserve_state, step_together


def test_reserved_state_gives_the_same_steps_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (4,), (2, 2, 2)]
    lazy = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]
    early = [torch.nn.Parameter(p.detach().clone()) for p in lazy]
    frozen = torch.nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False)
    opt_lazy, opt_early = make_adam(lazy, 1e-2), make_adam([*early, frozen], 1e-2)
    reserve_state(opt_early)
    assert all(torch.equal(a, b) for a, b in zip(lazy, early, strict=True))  # nothing moved
    assert all(p.grad is None for p in early)
    assert set(opt_early.state) == set(early)  # moments exist before any real step
    assert all(float(opt_early.state[p]["step"]) == 0 for p in early)
    assert opt_early.param_groups[0]["lr"] == 1e-2
    for _ in range(3):
        for a, b in zip(lazy, early, strict=True):
            grad = torch.randn(a.shape, generator=gen, dtype=torch.float64)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt_lazy.step()
        opt_early.step()
    for a, b in zip(lazy, early, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_lazy.state[a][key], opt_early.state[b][key])


def test_reserving_twice_or_after_steps_changes_nothing():
    params = [torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]
    opt = make_adam(params, 1e-2)
    params[0].grad = torch.ones(3, dtype=torch.float64)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    reserve_state(opt)
    assert all(torch.equal(before[k], opt.state[params[0]][k]) for k in before)


def _optimisers(seed: int, count: int = 3) -> tuple[list[list[torch.Tensor]], list]:
    gen = torch.Generator().manual_seed(seed)
    groups = [
        [torch.nn.Parameter(torch.randn(n, 3, generator=gen, dtype=torch.float64)) for n in (4, 7)]
        for _ in range(count)
    ]
    optimisers = [make_adam(params, 1e-2) for params in groups]
    for opt in optimisers:
        reserve_state(opt)
    return groups, optimisers


def test_stepping_together_equals_each_step_bit_for_bit():
    apart, separate = _optimisers(0)
    joint, together = _optimisers(0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for a, b in zip(sum(apart, []), sum(joint, []), strict=True):
            a.grad = torch.randn(a.shape, generator=gen, dtype=torch.float64)
            b.grad = a.grad.clone()
        for opt in separate:
            opt.step()
        step_together(together)
    for a, b in zip(sum(apart, []), sum(joint, []), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(apart[0][0], _optimisers(0)[0][0][0])  # the steps moved them
    for sep, tog in zip(separate, together, strict=True):
        for pa, pb in zip(
            sep.param_groups[0]["params"], tog.param_groups[0]["params"], strict=True
        ):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(sep.state[pa][key], tog.state[pb][key])


def test_stepping_together_falls_back_when_settings_differ():
    groups, optimisers = _optimisers(2, count=2)
    optimisers[1].param_groups[0]["eps"] = 1e-6
    for p in sum(groups, []):
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in sum(groups, [])]
    step_together(optimisers)
    assert all(not torch.equal(a, p) for a, p in zip(before, sum(groups, []), strict=True))
