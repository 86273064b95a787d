"""A committee's fitting parameters kept stacked for good: each member's parameter is a view
of its row of one (K, …) tensor, so that the batched fitting node takes the stack as it is.

The batched fitting node (``fitting_node.members_fitting_with_grad``) takes each parameter of
the K members' nets as one (K, …) tensor. Stacking them at every step copied every fitting
parameter (about 4 M float64 values, 32 MB, on the DFT water model's committee of 4) and
autograd took the stack apart again in the backward. Here the stack is made once: each
member's ``nn.Parameter`` keeps its identity (the optimiser, the checkpoints and the gradient
buckets see the member's own parameters) but its data becomes row k of the stack, so the
optimiser's in-place updates of the members' parameters are updates of the stack. `views`
hands the node the stacks; their backward gives member k row k of each stacked gradient (a
view: no copy either). Anything that gives a member parameter other data (``.to()``,
``load_state_dict(assign=True)``, which even replaces the ``nn.Parameter``) is noticed at the
next `views`, which stacks again.

A member's checkpoint holds its own values only: ``own_values`` (a state-dict hook on each
member) clones the views, which ``torch.save`` would otherwise write with the whole stack.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class StackedParams:
    """The parameters ``members[k][i]`` (member k, parameter i; the same shapes for every
    k) as stacks ``stacks[i]`` (K, …) whose row k is member k's parameter i."""

    def __init__(self, members: Sequence[Sequence[Tensor]]) -> None:
        self.members = [list(m) for m in members]
        self.shapes = [p.shape for p in self.members[0]]
        self.stacks: list[Tensor] = []
        self._stack()

    @torch.no_grad()
    def _stack(self) -> None:
        self.stacks = []
        for column in zip(*self.members, strict=True):
            stack = torch.stack([p.detach() for p in column])
            for k, p in enumerate(column):
                p.data = stack[k]
            self.stacks.append(stack)

    def _in_place(self, members: Sequence[Sequence[Tensor]]) -> bool:
        """Whether ``members`` are the parameters stacked, each still the view of its row."""
        for k, (params, mine) in enumerate(zip(members, self.members, strict=True)):
            for p, q, stack in zip(params, mine, self.stacks, strict=True):
                row = stack[k]
                if p is not q or p.data_ptr() != row.data_ptr() or p.shape != row.shape:
                    return False
        return True

    def views(self, members: Sequence[Sequence[Tensor]]) -> tuple[Tensor, ...]:
        """The stacks of the parameters ``members`` (as in the constructor: the modules'
        current ones, stacked again if they are not those stacked) as inputs of the batched
        node: matrices (K, n, m), vectors (K, 1, n); their gradients reach ``members``."""
        if len(members) != len(self.members) or not self._in_place(members):
            self.members = [list(m) for m in members]
            self._stack()
        flat = [p for member in self.members for p in member]
        return _StackViews.apply(self, *flat)


class _StackViews(torch.autograd.Function):
    """The stacks (no copy) as a function of the members' parameters (identity in value)."""

    @staticmethod
    def forward(ctx, stacked: StackedParams, *params: Tensor) -> tuple[Tensor, ...]:
        ctx.k, ctx.shapes = len(stacked.members), stacked.shapes
        return tuple(
            s.view(s.shape[0], 1, -1) if s.dim() == 2 else s.view(s.shape) for s in stacked.stacks
        )

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: Tensor | None):
        rows: list[Tensor | None] = []
        for k in range(ctx.k):
            for g, shape in zip(grads, ctx.shapes, strict=True):
                rows.append(None if g is None else g[k].reshape(shape))
        return (None, *rows)


def stackable(members: Sequence[Sequence[Tensor]]) -> bool:
    """Whether the parameters are plain tensors, whose rows of a stack are views of it
    (a tensor subclass wrapping another tensor need not alias its views: those are stacked
    per call)."""
    return all(type(p.data) is Tensor for params in members for p in params)


def own_values(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook: tensors that are views of a larger storage (a member's rows of the
    stacks) replaced by copies, so that a member's state holds its own values only."""
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, Tensor) and _a_view(value):
            state_dict[key] = value.clone()


def _a_view(t: Tensor) -> bool:
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()
