"""The optimiser: Adam in the fastest form this torch has for the parameters' device, and
its state restored from a checkpoint without the writer's implementation flags.

Apart from the loop because benchmarks and tests build the same optimiser without a Trainer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.adam import adam as functional_adam

FUSED_ADAM_DEVICES = ("cuda", "cpu")  # where torch has a fused Adam (CPU since torch 2.4)


def make_adam(params: list[torch.Tensor], lr: float) -> torch.optim.Adam:
    """Adam as one fused kernel over all parameters where this torch has it for their device
    (CPU since torch 2.4): a third of the multi-tensor version's time, which passes over the
    parameters and moments several times. The two differ in the last bits of a step, not more.
    Newer torch checks the device only at the first step, so the device is checked here.
    """
    if all(p.device.type in FUSED_ADAM_DEVICES for p in params):
        try:
            return torch.optim.Adam(params, lr=lr, fused=True)
        except (RuntimeError, ValueError):
            pass
    return torch.optim.Adam(params, lr=lr, foreach=True)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore moments and hyperparameters, but keep this process's implementation (fused or
    multi-tensor): the saved flags belong to the torch and device that wrote the checkpoint,
    and a fused flag from a newer torch would fail on an older one."""
    implementation = [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, (fused, foreach) in zip(optimizer.param_groups, implementation, strict=True):
        group["fused"], group["foreach"] = fused, foreach


def reserve_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimiser's moments now, while memory is free, instead of inside the first
    step: a step that ran out of memory half-way through creating them would leave some
    parameters updated and others not. One step with zero gradients at learning rate 0 creates
    them (zeros, parameters unchanged); the step counts then go back to 0, so the state is
    exactly what the first real step would have created."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved_lr, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None
        step = optimizer.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = 0


# settings that must agree for optimisers to step together; the others must be off
_SAME = ("lr", "betas", "eps", "weight_decay", "maximize", "foreach", "fused")
_OFF = ("amsgrad", "capturable", "differentiable", "decoupled_weight_decay")


def step_together(optimizers: Sequence[torch.optim.Adam]) -> None:
    """The steps of several Adam optimisers (a committee's members) as one call of torch's
    functional Adam. Adam updates every parameter on its own, so each parameter gets exactly
    the update of its own optimiser's step; one fused pass over all of them costs less than
    one per optimiser (and on a busy machine far less: each pass is a parallel region). Falls
    back to the optimisers' own steps when their settings differ or a state is missing."""
    groups = [g for opt in optimizers for g in opt.param_groups]
    first = groups[0]
    lists: tuple[list, list, list, list, list] = ([], [], [], [], [])
    together = all(g.get(k) == first.get(k) for g in groups for k in _SAME) and not any(
        g.get(k) for g in groups for k in _OFF
    )
    for opt in optimizers if together else ():
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p)
                if p.grad is None:
                    continue
                if not state or p.grad.is_sparse or torch.is_complex(p):
                    together = False
                    break
                for into, value in zip(
                    lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])
                ):
                    into.append(value)
    if not together:
        for opt in optimizers:
            opt.step()
        return
    params, grads, exp_avgs, exp_avg_sqs, steps = lists
    beta1, beta2 = first["betas"]
    with torch.no_grad():
        functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=first["foreach"], fused=first["fused"], amsgrad=False, beta1=beta1,
            beta2=beta2, lr=first["lr"], weight_decay=first["weight_decay"], eps=first["eps"],
            maximize=first["maximize"],
        )  # fmt: skip
