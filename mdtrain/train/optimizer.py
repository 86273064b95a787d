"""The optimiser of the ``optimizer`` section (DeePMD-kit 3.2's types): Adam in the fastest
form this torch has for the parameters' device, AdamW, AdaMuon (``mdtrain.train.muon``) and
HybridMuon (``mdtrain.train.hybrid_muon``); its state restored from a checkpoint without the writer's
implementation flags.

Apart from the loop because benchmarks and tests build the same optimiser without a Trainer.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch.optim.adam import adam as functional_adam

from mdtrain.errors import MDTrainError
from mdtrain.train.hybrid_muon import HybridMuon
from mdtrain.train.muon import AdaMuon

FUSED_ADAM_DEVICES = ("cuda", "cpu")  # where torch has a fused Adam (CPU since torch 2.4)


def _plain(function):
    """``function`` without the decorators torch puts around it (``functools.wraps``
    chains: ``torch._disable_dynamo``, the step's grad-mode wrapper and profiler hook)."""
    return inspect.unwrap(function)


_ADAM_STEP = _plain(torch.optim.Adam.step)
_ZERO_GRAD = _plain(torch.optim.Optimizer.zero_grad)


class _Eager:
    """torch's optimiser methods as they are, without their ``torch._disable_dynamo``
    wrappers: each wrapper imports ``torch._dynamo`` (with sympy, about 1.5 s of CPU) the
    first time it is called, to switch off a compiler that mdtrain never runs around an
    optimiser. The same functions run, so the steps and the state are torch's own."""

    add_param_group = _plain(torch.optim.Optimizer.add_param_group)
    state_dict = _plain(torch.optim.Optimizer.state_dict)
    load_state_dict = _plain(torch.optim.Optimizer.load_state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with ``set_to_none`` (the training step's, every step) its
        loop alone: every gradient dropped, without the profiler scope and the per-device
        lists around it (about 15 µs a step)."""
        if not set_to_none:
            return _ZERO_GRAD(self, set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


class EagerAdam(_Eager, torch.optim.Adam):
    """`torch.optim.Adam` whose first call imports no compiler (see `_Eager`)."""

    def step(self, closure=None):
        # torch's wrapper of Adam.step: gradients off (``differentiable`` is never set here)
        # and a graph break, which means nothing outside torch.compile
        with torch.no_grad():
            return _ADAM_STEP(self, closure)


class EagerAdamW(_Eager, torch.optim.AdamW):
    """`torch.optim.AdamW` whose first call imports no compiler (see `_Eager`)."""

    step = EagerAdam.step


def make_optimizer(
    section: dict | None, named: list[tuple[str, torch.Tensor]], lr: float
) -> torch.optim.Optimizer:
    """The optimiser a (completed) ``optimizer`` section asks for, over the trainable
    parameters ``named`` (HybridMuon routes some by name). Adam with DeePMD-kit's defaults
    is exactly `make_adam`'s."""
    section = section or {}
    kind = section.get("type", "Adam")
    params = [p for _, p in named]
    betas = (float(section.get("adam_beta1", 0.9)), float(section.get("adam_beta2", 0.999)))
    decay = float(section.get("weight_decay", 0.0))
    if kind == "Adam":
        return make_adam(params, lr, betas, decay)
    if kind == "AdamW":
        return make_adam(params, lr, betas, decay, decoupled=True)
    muon = {
        "momentum": float(section.get("momentum", 0.95)),
        "weight_decay": decay,
        "adam_betas": betas,
        # DeePMD-kit's defaults by type (the schema fills them; a config built by hand may not)
        "lr_adjust": float(section.get("lr_adjust", 10.0 if kind == "AdaMuon" else 0.0)),
        "lr_adjust_coeff": float(
            section.get("lr_adjust_coeff", 0.2 if kind == "AdaMuon" else 0.18)
        ),
    }
    if kind == "AdaMuon":
        return AdaMuon(params, lr=lr, **muon)
    if kind == "HybridMuon":
        return HybridMuon(
            named, lr=lr, muon_mode=section.get("muon_mode", "slice"),
            enable_gram=bool(section.get("enable_gram", True)),
            magma_muon=bool(section.get("magma_muon", True)), **muon,
        )  # fmt: skip
    raise MDTrainError(f"optimizer.type: unknown optimiser {kind!r}")


def make_adam(
    params: list[torch.Tensor],
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
    decoupled: bool = False,
) -> torch.optim.Adam:
    """Adam as one fused kernel over all parameters where this torch has it for their device
    (CPU since torch 2.4): a third of the multi-tensor version's time, which passes over the
    parameters and moments several times. The two differ in the last bits of a step, not more.
    Newer torch checks the device only at the first step, so the device is checked here.
    """
    kind = EagerAdamW if decoupled else EagerAdam
    settings = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
    if all(p.device.type in FUSED_ADAM_DEVICES for p in params):
        try:
            return kind(params, **settings, fused=True)
        except (RuntimeError, ValueError):
            pass
    return kind(params, **settings, foreach=True)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore moments and hyperparameters, but keep this process's implementation (fused or
    multi-tensor): the saved flags belong to the torch and device that wrote the checkpoint,
    and a fused flag from a newer torch would fail on an older one."""
    flags = ("fused", "foreach")
    implementation = [{k: g[k] for k in flags if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, own in zip(optimizer.param_groups, implementation, strict=True):
        group.update(own)


def reserve_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimiser's moments now, while memory is free, instead of inside the first
    step: a step that ran out of memory half-way through creating them would leave some
    parameters updated and others not. One step with zero gradients at learning rate 0 creates
    them (zeros, parameters unchanged); the step counts then go back to 0, so the state is
    exactly what the first real step would have created. Only torch's Adam and AdamW: the
    Muon variants keep counters such a step would advance."""
    if optimizer.state or not isinstance(optimizer, torch.optim.Adam):
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
    back to the optimisers' own steps when their settings differ or a state is missing (and
    one optimiser, a single run's, takes its own step)."""
    if len(optimizers) == 1:
        optimizers[0].step()
        return
    groups = [g for opt in optimizers for g in opt.param_groups]
    first = groups[0]
    lists: tuple[list, list, list, list, list] = ([], [], [], [], [])
    together = (
        all(type(opt) in (torch.optim.Adam, EagerAdam) for opt in optimizers)
        and all(g.get(k) == first.get(k) for g in groups for k in _SAME)
        and not any(g.get(k) for g in groups for k in _OFF)
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
