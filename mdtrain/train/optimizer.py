"""The optimiser: Adam in the fastest form this torch has for the parameters' device, and
its state restored from a checkpoint without the writer's implementation flags.

Apart from the loop because benchmarks and tests build the same optimiser without a Trainer.
"""

from __future__ import annotations

import torch


def make_adam(params: list[torch.Tensor], lr: float) -> torch.optim.Adam:
    """Adam as one fused kernel over all parameters where this torch has it for their device
    (CPU since torch 2.4): a third of the multi-tensor version's time, which passes over the
    parameters and moments several times. The two differ in the last bits of a step, not more.
    """
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.Adam(params, lr=lr, foreach=True)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore moments and hyperparameters, but keep this process's implementation (fused or
    multi-tensor): the saved flags belong to the torch and device that wrote the checkpoint,
    and a fused flag from a newer torch would fail on an older one."""
    implementation = [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, (fused, foreach) in zip(optimizer.param_groups, implementation, strict=True):
        group["fused"], group["foreach"] = fused, foreach
