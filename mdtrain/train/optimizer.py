"""The optimiser: Adam in the fastest form this torch has for the parameters' device, and
its state restored from a checkpoint without the writer's implementation flags.

Apart from the loop because benchmarks and tests build the same optimiser without a Trainer.
"""

from __future__ import annotations

import torch

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
