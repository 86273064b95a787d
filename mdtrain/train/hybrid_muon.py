"""HybridMuon, DeePMD-kit 3.2's default-path Muon optimiser (``optimizer.type =
"HybridMuon"``), with its update rule (``deepmd/pt/optimizer/hybrid_muon.py``).

Routing, fixed at the first step, by the parameter's name and shape (singleton dimensions
dropped):

- last name segment ``b``, containing ``bias`` or starting with ``adam_``, or fewer than two
  effective dimensions: Adam without weight decay;
- starting with ``adamw_``, or a shape ``muon_mode`` does not take as matrices (``2d``: more
  than two dimensions): Adam with decoupled weight decay ``p *= 1 - lr_adam * weight_decay``;
- the rest: Muon on ``(batch, rows, cols)`` views (``2d``/``flat``: one matrix,
  ``(prod(shape[:-1]), shape[-1])`` for ``flat``; ``slice``: the last two dimensions, the
  leading ones a batch).

Adam here keeps float32 moments (``lerp``), bias corrections from running powers of the
betas, ``eps`` 1e-20, at ``lr`` (``lr_adjust <= 0``) or ``lr / lr_adjust``.

Muon: ``p *= 1 - lr * weight_decay``; Nesterov momentum ``m = lerp(m, g, 1 - momentum)``,
``u = lerp(g, m, momentum)``; with ``magma_muon`` each block's update is damped by
``0.1 + 0.9 * s``, ``s`` an average (decay 0.9, from 0.5) of the block's momentum-gradient
cosine mapped through ``sigmoid(cos / 2)`` stretched to [0, 1]; ``u`` is orthogonalised —
rectangular matrices with ``enable_gram`` by the Gram Newton-Schulz iteration (float32
normalisation, five Polar-Express steps in float16, restarted before the third), the others
by 8 + 2 quintic Newton-Schulz steps in bfloat16 — and scaled by ``lr_adjust_coeff *
sqrt(max(m, n))`` (``lr_adjust <= 0``) or ``sqrt(max(1, m / n))``; ``p -= lr * update``.

DeePMD-kit compiles the Gram iteration with ``torch.compile`` and may use a triton kernel for
large square matrices on CUDA (``flash_muon``); here both run as plain eager PyTorch with the
same arithmetic, so the last bits of the half-precision iterations may differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from mdtrain.train.muon import FLOAT32_STATE, Float32StateOptimizer, adam_step

NS_FAST, NS_FAST_STEPS = (3.4445, -4.7750, 2.0315), 8
NS_POLISH, NS_POLISH_STEPS = (2.0, -1.5, 0.5), 2
NS_EPS = 1e-7
ADAM_EPS = 1e-20
_SAFETY = 1.05
POLAR_EXPRESS = tuple(
    (a / _SAFETY, b / _SAFETY**3, c / _SAFETY**5)
    for a, b, c in (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    )
)
GRAM_RESTART = 2  # the Polar-Express step before which X is rebuilt from the transform
MAGMA_TAU, MAGMA_DECAY, MAGMA_MIN = 2.0, 0.9, 0.1
MAGMA_LOW = 1.0 / (1.0 + math.exp(1.0 / MAGMA_TAU))
MAGMA_HIGH = 1.0 / (1.0 + math.exp(-1.0 / MAGMA_TAU))


def route(name: str, shape: torch.Size, mode: str) -> tuple[str, tuple[int, int, int] | None]:
    """``("adam" | "adamw" | "muon", (batch, rows, cols) for Muon)`` of one parameter."""
    segments = name.lower().split(".")
    k = len(segments) - 1
    while k > 0 and segments[k].isdigit():
        k -= 1
    leaf = segments[k]
    if leaf == "b" or "bias" in leaf or leaf.startswith("adam_"):
        return "adam", None
    if leaf.startswith("adamw_"):
        return "adamw", None
    eff = tuple(int(d) for d in shape if int(d) != 1) or (1,)
    if len(eff) < 2:
        return "adam", None
    if mode == "2d" and len(eff) != 2:
        return "adamw", None
    if mode == "flat":
        return "muon", (1, math.prod(eff[:-1]), eff[-1])
    return "muon", (math.prod(eff[:-2]), eff[-2], eff[-1])


def quintic_orthogonalize(x: torch.Tensor) -> torch.Tensor:
    """8 fast + 2 polishing quintic Newton-Schulz steps in bfloat16 on a (batch, m, n) stack."""
    x = x.to(torch.bfloat16)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.transpose(-2, -1)
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for (a, b, c), steps in ((NS_FAST, NS_FAST_STEPS), (NS_POLISH, NS_POLISH_STEPS)):
        for _ in range(steps):
            gram = torch.bmm(x, x.transpose(-2, -1))
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x.transpose(-2, -1) if tall else x


def gram_orthogonalize(x: torch.Tensor) -> torch.Tensor:
    """The Gram Newton-Schulz iteration on a (batch, m, n) stack of wide matrices (m <= n):
    the iterations run on ``R = X Xᵀ`` and accumulate the transform ``Q``, ``X_out = Q X``."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)).to(torch.float16)
    gram = torch.bmm(x, x.mT)
    eye = torch.eye(gram.size(-1), dtype=x.dtype, device=x.device).expand_as(gram).contiguous()
    transform = None
    last = len(POLAR_EXPRESS) - 1
    for k, (a, b, c) in enumerate(POLAR_EXPRESS):
        if k == GRAM_RESTART:
            x = torch.bmm(transform, x)
            gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        if k in (0, GRAM_RESTART):
            transform = poly + a * eye
        else:
            transform = torch.baddbmm(transform, transform, poly, beta=a, alpha=1.0)
        if k < last and k + 1 != GRAM_RESTART:
            gram_poly = torch.baddbmm(gram, gram, poly, beta=a, alpha=1.0)
            gram = torch.baddbmm(gram_poly, poly, gram_poly, beta=a, alpha=1.0)
    return torch.bmm(transform, x).to(dtype)


class HybridMuon(Float32StateOptimizer):
    """Muon for matrices, Adam/AdamW for the rest, routed by name and shape (module doc)."""

    FLOAT32_STATE = (*FLOAT32_STATE, "magma_score")

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]],
        lr: float = 5e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.001,
        adam_betas: tuple[float, float] = (0.9, 0.95),
        lr_adjust: float = 0.0,
        lr_adjust_coeff: float = 0.18,
        muon_mode: str = "slice",
        enable_gram: bool = True,
        magma_muon: bool = True,
    ) -> None:
        named = list(named_params)
        if muon_mode not in ("2d", "flat", "slice"):
            raise ValueError(f"unknown muon_mode {muon_mode!r}")
        defaults = {
            "lr": lr, "momentum": momentum, "weight_decay": weight_decay,
            "adam_betas": tuple(adam_betas), "lr_adjust": lr_adjust,
            "lr_adjust_coeff": lr_adjust_coeff, "muon_mode": muon_mode,
            "enable_gram": enable_gram, "magma_muon": magma_muon,
        }  # fmt: skip
        super().__init__([p for _, p in named], defaults)
        self.routes = {id(p): route(n, p.shape, muon_mode) for n, p in named}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lists: dict[str, list] = {"adam": [], "adamw": [], "muon": []}
            for p in group["params"]:
                if p.grad is not None:
                    kind, view = self.routes[id(p)]
                    lists[kind].append((p, view))
            lr, adjust = group["lr"], group["lr_adjust"]
            adam_lr = lr if adjust <= 0 else lr / adjust
            decay = group["weight_decay"]
            betas = group["adam_betas"]
            adam_step(self.state, [p for p, _ in lists["adam"]], betas, adam_lr, ADAM_EPS)
            decayed = [p for p, _ in lists["adamw"]]
            if decayed and decay > 0:
                torch._foreach_mul_(decayed, 1.0 - adam_lr * decay)
            adam_step(self.state, decayed, betas, adam_lr, ADAM_EPS)
            self._muon(group, lists["muon"])
        return loss

    def _muon(self, group: dict, entries: list) -> None:
        if not entries:
            return
        lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        if decay > 0:
            torch._foreach_mul_([p for p, _ in entries], 1.0 - lr * decay)
        buckets: dict[tuple, list] = {}
        for p, (batch, rows, cols) in entries:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buffer = state["momentum_buffer"]
            grad = p.grad.to(buffer.dtype)
            buffer.lerp_(grad, 1.0 - momentum)
            update = torch.lerp(grad, buffer, momentum)
            damp = self._magma(p, grad, buffer, batch) if group["magma_muon"] else None
            matrices = update.reshape(batch, rows, cols).contiguous()
            key = (rows, cols, update.device, update.dtype)
            buckets.setdefault(key, []).append((p, matrices, damp))
        gram: dict[tuple, list] = {}  # rectangular buckets by their smaller side
        for key, members in buckets.items():
            rows, cols = key[0], key[1]
            if group["enable_gram"] and rows != cols:
                gram.setdefault((min(rows, cols), *key[2:]), []).append((rows, cols, members))
                continue
            orth = quintic_orthogonalize(torch.cat([m for _, m, _ in members]))
            self._apply(group, members, orth, rows, cols)
        for parts in gram.values():
            # one iteration for all: wide matrices zero-padded to the longest side, which
            # leaves X Xᵀ, hence every step, unchanged (as DeePMD-kit batches them)
            longest = max(max(r, c) for r, c, _ in parts)
            wide = []
            for rows, cols, members in parts:
                for _, m, _ in members:
                    m = m.transpose(-2, -1) if rows > cols else m
                    wide.append(torch.nn.functional.pad(m, (0, longest - max(rows, cols))))
            orth = gram_orthogonalize(torch.cat(wide))
            offset = 0
            for rows, cols, members in parts:
                count = sum(len(m) for _, m, _ in members)
                part = orth[offset : offset + count, :, : max(rows, cols)]
                offset += count
                self._apply(
                    group, members, part.transpose(-2, -1) if rows > cols else part, rows, cols
                )

    def _apply(self, group: dict, members: list, orth: torch.Tensor, rows: int, cols: int) -> None:
        """``p -= lr * scale * damping * orth`` for the members of one bucket."""
        if group["lr_adjust"] <= 0:
            scale = group["lr_adjust_coeff"] * math.sqrt(float(max(rows, cols)))
        else:
            scale = max(1.0, rows / cols) ** 0.5
        offset = 0
        for p, matrices, damp in members:
            part = orth[offset : offset + len(matrices)] * scale
            offset += len(matrices)
            if damp is not None:
                part = part * damp.view(-1, 1, 1).to(part.dtype)
            p.add_(part.reshape(p.shape), alpha=-group["lr"])

    def _magma(self, p: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor, batch: int):
        """The block damping factors ``0.1 + 0.9 * s`` (``s`` updated in the state)."""
        state = self.state[p]
        score = state.get("magma_score")
        if score is None or score.numel() != batch:
            score = torch.full((batch,), 0.5, dtype=torch.float32, device=p.device)
        g = grad.reshape(batch, -1).float()
        m = buffer.reshape(batch, -1).float()
        cosine = ((m * g).sum(dim=1) / (m.norm(dim=1) * g.norm(dim=1)).clamp(min=1e-12)).clamp(
            -1.0, 1.0
        )
        raw = ((torch.sigmoid(cosine / MAGMA_TAU) - MAGMA_LOW) / (MAGMA_HIGH - MAGMA_LOW)).clamp(
            0.0, 1.0
        )
        score = MAGMA_DECAY * score + (1.0 - MAGMA_DECAY) * raw
        state["magma_score"] = score
        return MAGMA_MIN + (1.0 - MAGMA_MIN) * score
