"""The hybrid descriptor on the explicit-derivative backends: each member on its own explicit
form (se_e2_a's, se_e2_r's), as it would run alone.

The hybrid gives each member its slots of the model's list (``DescriptorHybrid.member_lists``,
the same blocks as the reference); each member computes its environment, its D from the
embedding contraction and, from its share of dE/dD, its row gradients, which its own form
pulls back to ``dE/d(pair vector)`` of its slots. Those are added into the slots of the
model's list they came from (``cut_index``: two members may share a slot), so the hybrid's
"row gradients" are already ``dE/dd``: its environment's scale is 1 and its pull-back the
identity. Only members that all have an explicit form get here (``backend.explicit_problem``),
so no member is type-mixed and no per-type blocks are drawn from a type-mixed list.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from mdtrain.model.accel.explicit_descriptor import (
    EmbeddingOps,
    Environment,
    ExplicitCache,
    ExplicitForm,
)
from mdtrain.model.descriptors.hybrid import DescriptorHybrid


class HybridEnvironment(NamedTuple):
    """The members' environments, with the fields the explicit model reads of any."""

    diff: Tensor  # (nf, N, nnei, 3) the model list's pair vectors
    coef: Tensor  # unused: each member pulls back with its own coefficients
    scale: Tensor  # 1 (0-dim): the members' scales are applied in ``hybrid_row_gradients``
    members: list[Environment]


class HybridCache(NamedTuple):
    """What ``hybrid_row_gradients`` needs: each member's cache and environment."""

    members: list[ExplicitCache]
    envs: list[Environment]


def hybrid_environment(
    forms: dict[str, ExplicitForm],
    desc: DescriptorHybrid,
    diff: Tensor,
    nlist: Tensor,
    atype: Tensor,
) -> HybridEnvironment:
    """Each member's environment on its slots of the list."""
    lists = desc.member_lists(diff, nlist, atype)
    envs = [
        forms[m.type_name].environment(m, own_diff, own_nlist, atype)
        for m, (own_diff, own_nlist) in zip(desc.members, lists, strict=True)
    ]
    return HybridEnvironment(diff, diff.new_zeros(0), diff.new_ones(()), envs)


def hybrid_contract(
    forms: dict[str, ExplicitForm],
    desc: DescriptorHybrid,
    ops: EmbeddingOps,
    env: HybridEnvironment,
    nf: int,
    natoms: int,
) -> tuple[Tensor, HybridCache]:
    """The members' D concatenated in list order (in the hybrid's dtype, as the reference)."""
    parts = [
        forms[m.type_name].contract(m, ops, own, nf, natoms)
        for m, own in zip(desc.members, env.members, strict=True)
    ]
    out = torch.cat([d.to(desc.dtype) for d, _ in parts], dim=-1)
    return out, HybridCache([cache for _, cache in parts], env.members)


def hybrid_row_gradients(
    forms: dict[str, ExplicitForm],
    desc: DescriptorHybrid,
    ops: EmbeddingOps,
    grad: Tensor,
    cache: HybridCache,
    atype: Tensor,
) -> Tensor:
    """dE/dd (nf, N, nnei, 3) float64 over the model list's slots from dE/dD (nf, N,
    dim_out): each member's row gradients from its columns of dE/dD, pulled back by its own
    form and added into the slots it was given."""
    nf, natoms = grad.shape[0], grad.shape[1]
    out = torch.zeros(nf, natoms, desc.nnei, 3, dtype=torch.float64, device=grad.device)
    start = 0
    for k, member in enumerate(desc.members):
        form, env = forms[member.type_name], cache.envs[k]
        part = grad[..., start : start + member.dim_out]
        start += member.dim_out
        rbar = form.row_gradients(member, ops, part, cache.members[k], atype)
        g = form.pull_back(rbar * env.scale, env.diff, env.coef).to(torch.float64)
        slots = desc.cut_index[desc.cut_starts[k] : desc.cut_starts[k + 1]]
        out = out.index_add(2, slots, g)
    return out


def pulled_back(qbar: Tensor, diff: Tensor, coef: Tensor) -> Tensor:
    """The hybrid's row gradients are already dE/dd (``hybrid_row_gradients``)."""
    return qbar


def hybrid_form(forms: dict[str, ExplicitForm]) -> ExplicitForm:
    """The hybrid's explicit form over members whose forms are ``forms`` (by type name)."""
    return ExplicitForm(
        partial(hybrid_environment, forms),
        partial(hybrid_contract, forms),
        partial(hybrid_row_gradients, forms),
        pulled_back,
    )
