"""The optimiser's state reserved before the first step changes nothing of what it computes;
the optimiser is torch's Adam bit for bit, without importing torch's compiler."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mdtrain.train.optimizer import EagerAdam, EagerAdamW, make_adam, reserve_state, step_together


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


def _pair(kind, decoupled: bool, settings: dict, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    ours = [
        torch.nn.Parameter(torch.randn(n, 3, generator=gen, dtype=torch.float64)) for n in (4, 2)
    ]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    torch_kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    return (
        ours,
        kind(ours, lr=1e-2, weight_decay=0.1, **settings),
        theirs,
        torch_kind(theirs, lr=1e-2, weight_decay=0.1, **settings),
    )


@pytest.mark.parametrize("settings", [{"fused": True}, {"foreach": True}, {"foreach": False}])
@pytest.mark.parametrize("decoupled", [False, True])
def test_eager_adam_steps_and_state_are_torchs_bit_for_bit(settings, decoupled):
    kind = EagerAdamW if decoupled else EagerAdam
    ours, opt, theirs, ref = _pair(kind, decoupled, settings)
    assert isinstance(opt, type(ref))
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen, dtype=torch.float64)
            b.grad = a.grad.clone()
        if step == 2:  # a checkpoint's round trip on the way
            state = opt.state_dict()
            assert repr(state["param_groups"]) == repr(ref.state_dict()["param_groups"])
            opt.load_state_dict(state)
        opt.step()
        ref.step()
        opt.zero_grad()
        assert all(p.grad is None for p in ours)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][key], ref.state[b][key])
    assert not torch.equal(ours[0], _pair(kind, decoupled, settings)[0][0])  # they moved


def test_the_optimiser_imports_no_compiler():
    """make_adam's optimiser, its steps, zero_grad and its state's round trip leave
    torch._dynamo unimported (about 1.5 s of every training process's start)."""
    script = (
        "import sys, torch\n"
        "if 'torch._dynamo' in sys.modules: print('imported by torch'); sys.exit(0)\n"
        "from mdtrain.train.optimizer import make_adam, reserve_state\n"
        "for decoupled in (False, True):\n"
        "    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))\n"
        "    opt = make_adam([p], 1e-2, decoupled=decoupled)\n"
        "    reserve_state(opt)\n"
        "    p.grad = torch.ones(3, dtype=torch.float64)\n"
        "    opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    if done.stdout.strip() == "imported by torch":
        pytest.skip("this torch imports torch._dynamo itself")
    assert done.stdout.strip() == "False"


def test_eager_zero_grad_drops_or_zeroes_every_gradient():
    """`EagerAdam.zero_grad`'s own loop (``set_to_none``) leaves no gradient, in every
    group; ``set_to_none=False`` is torch's (zeroed tensors kept)."""
    from mdtrain.train.optimizer import EagerAdam

    params = [torch.nn.Parameter(torch.rand(3)) for _ in range(4)]
    opt = EagerAdam([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}], fused=True)
    for p in params:
        p.grad = torch.ones(3)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
