"""The step of a run's Adam optimisers as direct calls of torch's fused kernel, over lists
of parameters and moments gathered once instead of at every step.

torch's ``Adam.step`` walks every parameter group in Python at each step (its lazy state
check, its lists of parameters, gradients, moments and step counts, then the functional
``adam`` and ``_fused_adam`` wrappers that group them again by device and dtype): about
0.7 ms of the 1.9 ms a float32 water step's update costs, all of it on one thread. The
kernel (``torch._fused_adam_``, or ``_fused_adamw_`` for AdamW) updates every tensor on its
own, so calling it with the same tensors, step counts and hyperparameters as torch's own
path gives the same bits; only the gradients change from step to step (``zero_grad`` sets
them to ``None``) and are read at each call.

The lists are gathered again whenever an optimiser's state or parameter groups are not the
objects they were gathered from (``load_state_dict`` replaces both); anything this path
does not cover (another optimiser, a missing gradient or state, a sharded optimiser,
differing or unusual settings, a tensor learning rate, AMP's gradient scale) takes
`step_together`, torch's own step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mdtrain.train.optimizer import EagerAdam, EagerAdamW, step_together

_ADAMS = (torch.optim.Adam, torch.optim.AdamW, EagerAdam, EagerAdamW)
# settings the kernel takes as arguments: every group must agree (read at every step)
_SAME = ("lr", "betas", "eps", "weight_decay", "maximize", "decoupled_weight_decay")
# settings this path does not cover
_OFF = ("amsgrad", "capturable", "differentiable", "foreach")


class _Bucket:
    """The tensors of one device and dtype, in the optimisers' parameter order."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []
        self.counts = torch.zeros(0)

    def share_counts(self, states: list[dict]) -> None:
        """Each parameter's step count made a view of one vector, which one ``add_`` then
        advances, instead of ``_foreach_add_`` over 0-d tensors (about 80 us of one thread
        for 32 of them). Every count keeps its own value and its own tensor in the state
        (torch's own step advances each view once; a checkpoint holds the same values)."""
        self.counts = torch.stack(self.steps)
        self.steps = [self.counts[i] for i in range(len(self.steps))]
        for state, count in zip(states, self.steps, strict=True):
            state["step"] = count


class _Plan:
    """What a step needs, gathered from the optimisers' current state objects."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        # the objects gathered from: a step checks that they are still the optimisers'
        self.sources = [(opt.state, opt.param_groups, len(opt.param_groups)) for opt in optimizers]
        self.groups = [g for opt in optimizers for g in opt.param_groups]
        buckets: dict[tuple, _Bucket] = {}
        owners: dict[int, list[dict]] = {}  # per bucket, the states its step counts are in
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p)
                    bucket = buckets.setdefault((p.device, p.dtype), _Bucket())
                    owners.setdefault(id(bucket), []).append(state)
                    bucket.params.append(p)
                    bucket.exp_avgs.append(state["exp_avg"])
                    bucket.exp_avg_sqs.append(state["exp_avg_sq"])
                    bucket.steps.append(state["step"])
        self.buckets = list(buckets.values())
        for bucket in self.buckets:
            bucket.share_counts(owners[id(bucket)])

    def current(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        return all(
            opt.state is state and opt.param_groups is groups and len(groups) == count
            for opt, (state, groups, count) in zip(optimizers, self.sources, strict=True)
        )


def _coverable(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether the fused kernel can take these optimisers' step with lists gathered now."""
    for opt in optimizers:
        if type(opt) not in _ADAMS or getattr(opt, "grad_scale", None) is not None:
            return False
        for group in opt.param_groups:
            if not group.get("fused") or "decoupled_weight_decay" not in group:
                return False  # (an older torch's AdamW has no such key: its own step)
            for p in group["params"]:
                state = opt.state.get(p)
                if not state or torch.is_complex(p) or "exp_avg" not in state:
                    return False
                step = state.get("step")
                if not isinstance(step, torch.Tensor) or step.device != p.device:
                    return False
    return True


class AdamSteps:
    """The update of ``optimizers`` (a single run's one, or a committee's members') after each
    backward: torch's fused Adam kernel called directly where it applies, else
    `step_together`. Equal, bit for bit, to each optimiser's own ``step()``."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self._plan: _Plan | None = None

    def _settings(self, plan: _Plan) -> dict | None:
        """The groups' common hyperparameters, None when they differ or are not covered."""
        first = plan.groups[0]
        for group in plan.groups:
            if any(group.get(k) for k in _OFF) or not group.get("fused"):
                return None
            if group is not first and any(group.get(k) != first.get(k) for k in _SAME):
                return None
        if isinstance(first["lr"], torch.Tensor):
            return None
        return first

    def step(self) -> None:
        """One update of every parameter from its current gradient."""
        plan = self._plan
        if plan is None or not plan.current(self.optimizers):
            plan = self._plan = _Plan(self.optimizers) if _coverable(self.optimizers) else None
        settings = None if plan is None else self._settings(plan)
        grads = None if settings is None else [[p.grad for p in b.params] for b in plan.buckets]
        if grads is None or any(g is None for part in grads for g in part):
            step_together(self.optimizers)  # torch's own step (and its lazy state)
            self._plan = None  # it may have created state: gather again next time
            return
        beta1, beta2 = settings["betas"]
        kernel = torch._fused_adamw_ if settings["decoupled_weight_decay"] else torch._fused_adam_
        with torch.no_grad():
            for bucket, part in zip(plan.buckets, grads, strict=True):
                bucket.counts.add_(1)  # every parameter's step count
                kernel(
                    bucket.params, part, bucket.exp_avgs, bucket.exp_avg_sqs, [],
                    bucket.steps, amsgrad=False, lr=settings["lr"], beta1=beta1,
                    beta2=beta2, weight_decay=settings["weight_decay"], eps=settings["eps"],
                    maximize=settings["maximize"], grad_scale=None, found_inf=None,
                )  # fmt: skip
