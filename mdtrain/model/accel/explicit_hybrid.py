"""The hybrid descriptor on the explicit-derivative backends: each member on its own explicit
form (se_e2_a's, se_e2_r's), as it would run alone.

The hybrid gives each member its slots of the model's list (``DescriptorHybrid.member_lists``,
the same blocks as the reference); each member computes its environment (with its own pair
plan for the force node), its D from the embedding contraction and, from its columns of
dE/dD, its row gradients. Forces and virials are linear in the row gradients, so they are
the sum of each member's force node on its own pairs (two members may share a pair of the
list: their terms add, as in the reference). Only members that all have an explicit form get
here (``backend.explicit_problem``), so no member is type-mixed and no per-type blocks are
drawn from a type-mixed list.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from mdtrain.model.accel.explicit import FORMS, ExplicitEnergyModel, with_pairs
from mdtrain.model.accel.explicit_descriptor import (
    EmbeddingOps,
    Environment,
    ExplicitCache,
    ExplicitForm,
)
from mdtrain.model.accel.fitting_compiled import fitting_node_for
from mdtrain.model.accel.force_node import forces_and_virial
from mdtrain.model.accel.pair_vectors import CompiledPairVectors
from mdtrain.model.descriptors.hybrid import DescriptorHybrid
from mdtrain.model.energy import EnergyModel


class HybridEnvironment(NamedTuple):
    """Each member's environment on its slots of the list."""

    members: list[Environment]


def hybrid_environment(
    forms: dict[str, ExplicitForm],
    desc: DescriptorHybrid,
    diff: Tensor,
    nlist: Tensor,
    atype: Tensor,
    pairs=None,
) -> HybridEnvironment:
    """Each member's environment on its slots of the list (``pairs``: as
    ``explicit_descriptor.explicit_environment``'s)."""
    lists = desc.member_lists(diff, nlist, atype)
    return HybridEnvironment(
        [
            forms[m.type_name].environment(m, own_diff, own_nlist, atype, pairs)
            for m, (own_diff, own_nlist) in zip(desc.members, lists, strict=True)
        ]
    )


def hybrid_contract(
    forms: dict[str, ExplicitForm],
    desc: DescriptorHybrid,
    ops: EmbeddingOps,
    env: HybridEnvironment,
    nf: int,
    natoms: int,
) -> tuple[Tensor, list[ExplicitCache]]:
    """The members' D concatenated in list order (in the hybrid's dtype, as the reference)."""
    parts = [
        forms[m.type_name].contract(m, ops, own, nf, natoms)
        for m, own in zip(desc.members, env.members, strict=True)
    ]
    return torch.cat([d.to(desc.dtype) for d, _ in parts], dim=-1), [c for _, c in parts]


def hybrid_row_gradients(
    forms: dict[str, ExplicitForm],
    desc: DescriptorHybrid,
    ops: EmbeddingOps,
    grad: Tensor,
    cache: list[ExplicitCache],
    atype: Tensor,
) -> list[list[Tensor]]:
    """Each member's row gradients (its groups of rows) from its columns of dE/dD."""
    out: list[list[Tensor]] = []
    start = 0
    for k, member in enumerate(desc.members):
        part = grad[..., start : start + member.dim_out]
        start += member.dim_out
        out.append(forms[member.type_name].row_gradients(member, ops, part, cache[k], atype))
    return out


HYBRID_FORM = ExplicitForm(
    partial(hybrid_environment, FORMS),
    partial(hybrid_contract, FORMS),
    partial(hybrid_row_gradients, FORMS),
)


class ExplicitHybridModel(ExplicitEnergyModel):
    """``ExplicitEnergyModel`` of a hybrid: forces and virials summed over its members."""

    def __init__(self, model_config: dict, embedding: EmbeddingOps, pairs=None) -> None:
        EnergyModel.__init__(self, model_config)
        self.embedding = embedding
        self.backend = embedding.name
        self.form = with_pairs(HYBRID_FORM, pairs)
        self.vectors = None if pairs is None else CompiledPairVectors(pairs.lib)
        self.fitting_node = fitting_node_for(self.fitting, getattr(embedding, "kernels", None))

    def evaluate_environment(
        self,
        env: HybridEnvironment,
        diff: Tensor,
        nlist: Tensor,
        atype: Tensor,
        virial: bool = True,
    ) -> dict[str, Tensor]:
        """As ``ExplicitEnergyModel``'s, each member's force node on its own pairs (the
        virial always: ``virial`` is not used)."""
        nf, natoms = nlist.shape[0], nlist.shape[1]
        descriptor, cache = self.form.contract(self.descriptor, self.embedding, env, nf, natoms)
        atom_energy, grad = self.fitting_node(self.fitting, descriptor, atype)
        atom_energy, grad = self.biased(atom_energy, grad, atype)
        rbar = self.form.row_gradients(self.descriptor, self.embedding, grad, cache, atype)
        force, virial = None, None
        for own, pieces in zip(env.members, rbar, strict=True):
            f, v = forces_and_virial(own.force, pieces)
            force, virial = (f, v) if force is None else (force + f, virial + v)
        return {
            "energy": atom_energy.sum(dim=-1),
            "atom_energy": atom_energy,
            "force": force.view(nf, natoms, 3),
            "virial": virial.view(nf, 3, 3),
        }
