"""AdaMuon, DeePMD-kit 3.2's Muon variant (``optimizer.type = "AdaMuon"``), with its update
rule (``deepmd/pt/optimizer/adamuon.py``; Smith et al., arXiv:2507.11005).

Parameters of two or more dimensions (the nets' matrices) take the AdaMuon step:

1. decoupled weight decay ``p *= 1 - lr * weight_decay``;
2. Nesterov momentum ``m = lerp(m, g, 1 - momentum)``, ``u = lerp(g, m, momentum)``, viewed as
   a matrix ``(shape[0], rest)``;
3. ``o = orth(sign(u))``: five quintic Newton-Schulz iterations in bfloat16 (coefficients
   3.4445, -4.7750, 2.0315) on ``X / max(|X|_F, 1e-8)``, a wide matrix (tall ones
   transposed); matrices of one shape are orthogonalised together as a batch;
4. a second moment per element ``v = momentum * v + (1 - momentum) * o²``, ``o /= sqrt(v) +
   eps``, then ``o *= 0.2 * sqrt(m * n) / (|o| + eps)`` and the shape correction
   ``lr_adjust_coeff * sqrt(max(m, n))`` (``lr_adjust <= 0``) or ``sqrt(max(1, m / n))``;
5. ``p -= lr * o``.

Other parameters (biases) take Adam in float32 (moments by ``lerp``, bias corrections from
running powers of the betas) at ``lr`` (``lr_adjust <= 0``) or ``lr / lr_adjust``, without
weight decay. The state (moments, powers) is in ``state_dict``, so restarts continue exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
FLOAT32_STATE = ("exp_avg", "exp_avg_sq")  # kept in float32 whatever the parameters


def adam_step(
    states: dict, params: list[torch.Tensor], betas: tuple[float, float], lr: float, eps: float
) -> None:
    """The Adam step of the Muon variants: float32 moments by ``lerp``, bias corrections
    from running powers of the betas (kept in each parameter's state), no weight decay."""
    beta1, beta2 = betas
    for p in params:
        state = states[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["beta1_pow"], state["beta2_pow"] = 1.0, 1.0
        state["beta1_pow"] *= beta1
        state["beta2_pow"] *= beta2
        grad = p.grad.to(p.dtype).float()
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].lerp_(grad * grad, 1 - beta2)
        step_size = lr / (1 - state["beta1_pow"])
        denom = (state["exp_avg_sq"] / (1 - state["beta2_pow"])).sqrt().add_(eps)
        p.add_((-step_size * (state["exp_avg"] / denom)).to(p.dtype))


def newton_schulz(matrices: torch.Tensor, steps: int = 5, eps: float = 1e-8) -> torch.Tensor:
    """The orthogonal factor of each matrix of a ``(batch, m, n)`` stack, approximately (the
    ``U Vᵀ`` of its SVD), by quintic Newton-Schulz iterations in bfloat16."""
    a, b, c = NS_COEFFICIENTS
    x = matrices.to(torch.bfloat16)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x.mT if tall else x


class Float32StateOptimizer(torch.optim.Optimizer):
    """An optimiser whose moments named in ``FLOAT32_STATE`` stay float32 through
    ``load_state_dict`` (torch casts a loaded state to its parameter's dtype), so that a
    restart is an exact round trip whatever the parameters' dtype."""

    FLOAT32_STATE: tuple[str, ...] = FLOAT32_STATE

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in self.FLOAT32_STATE:
                if key in state:
                    state[key] = state[key].float()


class AdaMuon(Float32StateOptimizer):
    """AdaMuon for matrices, Adam for the rest (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        momentum: float = 0.95,
        weight_decay: float = 0.001,
        adam_betas: tuple[float, float] = (0.9, 0.95),
        lr_adjust: float = 10.0,
        lr_adjust_coeff: float = 0.2,
        ns_steps: int = 5,
        adam_eps: float = 1e-8,
        eps: float = 1e-8,
    ) -> None:
        defaults = {
            "lr": lr, "momentum": momentum, "weight_decay": weight_decay,
            "adam_betas": tuple(adam_betas), "lr_adjust": lr_adjust,
            "lr_adjust_coeff": lr_adjust_coeff, "ns_steps": ns_steps, "adam_eps": adam_eps,
            "eps": eps,
        }  # fmt: skip
        super().__init__(params, defaults)

    FLOAT32_STATE = (*FLOAT32_STATE, "v_buffer")

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            matrices, vectors = [], []
            for p in group["params"]:
                if p.grad is not None:
                    (matrices if p.ndim >= 2 else vectors).append(p)
            lr, decay = group["lr"], group["weight_decay"]
            if decay > 0 and matrices:
                torch._foreach_mul_(matrices, 1.0 - lr * decay)
            adam_lr = lr if group["lr_adjust"] <= 0 else lr / group["lr_adjust"]
            adam_step(self.state, vectors, group["adam_betas"], adam_lr, group["adam_eps"])
            self._muon(group, matrices)
        return loss

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        momentum, eps = group["momentum"], group["eps"]
        by_shape: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in params:
            state = self.state[p]
            grad = p.grad.to(p.dtype)
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buffer = state["momentum_buffer"]
            buffer.lerp_(grad, 1 - momentum)
            update = grad.lerp(buffer, momentum)
            if update.ndim > 2:
                update = update.reshape(update.shape[0], -1)
            by_shape.setdefault((*update.shape, update.device), []).append((p, update))
        for (m, n, _), members in by_shape.items():
            rms = 0.2 * math.sqrt(float(m * n))
            if group["lr_adjust"] <= 0:
                shape_scale = group["lr_adjust_coeff"] * math.sqrt(float(max(m, n)))
            else:
                shape_scale = max(1.0, m / n) ** 0.5
            signs = torch.stack([torch.sign(u.contiguous()) for _, u in members])
            orth = newton_schulz(signs, group["ns_steps"])
            for k, (p, _) in enumerate(members):
                state = self.state[p]
                o = orth[k].flatten().float()
                if "v_buffer" not in state:
                    state["v_buffer"] = torch.zeros(o.numel(), dtype=torch.float32, device=o.device)
                v = state["v_buffer"]
                v.mul_(momentum).addcmul_(o, o, value=1.0 - momentum)
                o = o / (v.sqrt().add_(eps))
                o.div_(o.norm() + eps).mul_(rms)
                o.mul_(shape_scale)
                p.add_(o.view(m, n).reshape(p.shape).to(p.dtype), alpha=-group["lr"])
