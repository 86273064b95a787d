"""The optimiser's state reserved before the first step changes nothing of what it computes."""

from __future__ import annotations

import torch

from mdtrain.train.optimizer import make_adam, reserve_state


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
