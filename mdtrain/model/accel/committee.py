"""The committee on the explicit-derivative backends: what depends on the frames only is
computed once for all members.

Members of a committee differ in their network weights only (``mdtrain.model.committee``):
the pair vectors, the environment matrix with its derivative coefficients, the normalised rows
(the same davg/dstd for every member) and the slot widths the embedding evaluates are one
`Environment`, computed once per batch; each member then runs its own embedding nets on it
(the compiled kernels reuse one block plan for all of them). The members' fitting nets run
as one node per atom type with batched products (``members_fitting_with_grad``) on their
parameters kept stacked (``accel.stacked``: each member's parameter a view of one stack), and what
follows the networks (the force node: the pull-back of dE/dR̃ through the environment matrix,
the force gather, the virial) runs once for all members, with members as a leading dimension.
Each member's outputs and gradients are its own; they equal the member's alone up to the
rounding of batched against single products (~1e-16 relative).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mdtrain.model.accel.explicit import ExplicitEnergyModel
from mdtrain.model.accel.explicit_descriptor import contract_environment, row_gradients
from mdtrain.model.accel.fitting_node import members_fitting_with_grad
from mdtrain.model.accel.force_node import forces_and_virial
from mdtrain.model.accel.layout import layer_params
from mdtrain.model.accel.stacked import StackedParams, own_values, stackable
from mdtrain.model.committee import Committee


class ExplicitCommittee(Committee):
    """A committee of ``ExplicitEnergyModel`` members of one backend that share their
    descriptor statistics (checked by the caller with ``stats_shared`` once they are set)."""

    def __init__(self, members: list[ExplicitEnergyModel]) -> None:
        kinds = {type(m.embedding) for m in members}
        if not all(isinstance(m, ExplicitEnergyModel) for m in members) or len(kinds) != 1:
            raise ValueError("an explicit committee needs explicit members of one backend")
        super().__init__(list(members))
        # per fitting net (atom type): the members' parameters as (K, ...) stacks, made at
        # the first forward (after the model is moved and its weights loaded)
        self._stacked: list[StackedParams] | None = None
        for member in members:  # a member's checkpoint holds its own values, not the stacks
            member._register_state_dict_hook(own_values)

    def forward(
        self, coord: Tensor, atype: Tensor, box: Tensor | None, nlist: Tensor, shift: Tensor
    ) -> list[dict[str, Tensor]]:
        """As ``Committee.forward``; graphs only when training with grad enabled."""
        if torch.is_grad_enabled() and self.training:
            return self._evaluate(coord, atype, box, nlist, shift)
        with torch.no_grad():
            return self._evaluate(coord, atype, box, nlist, shift)

    def _evaluate(
        self, coord: Tensor, atype: Tensor, box: Tensor | None, nlist: Tensor, shift: Tensor
    ) -> list[dict[str, Tensor]]:
        members = list(self.members)
        first = members[0]
        x = coord.detach().to(torch.float64)
        cell = None if box is None else box.detach().to(torch.float64)
        diff = first.pair_vectors(x, cell, nlist, shift)
        env = first.form.environment(first.descriptor, diff, nlist, atype)  # se_e2_a's
        n, (nf, natoms) = len(members), nlist.shape[:2]
        contracted = [
            contract_environment(m.descriptor, m.embedding, env, nf, natoms) for m in members
        ]
        fittings = [m.fitting for m in members]
        params = [  # per atom type's net: every member's parameters
            [layer_params(f.networks[c].layers) for f in fittings]
            for c in range(len(fittings[0].networks))
        ]
        stacked = None
        if all(stackable(p) for p in params):
            if self._stacked is None:
                self._stacked = [StackedParams(p) for p in params]
            stacked = [s.views(p) for s, p in zip(self._stacked, params, strict=True)]
        energies, grads = members_fitting_with_grad(
            fittings, torch.stack([c[0] for c in contracted]), atype, stacked
        )
        # unbind, not energies[k]: a select's backward fills a zero (K, ...) tensor per member
        parts = [
            m.biased(e, g, atype)
            for m, e, g in zip(members, energies.unbind(0), grads.unbind(0), strict=True)
        ]
        pieces = [
            piece
            for k, m in enumerate(members)
            for piece in row_gradients(
                m.descriptor, m.embedding, parts[k][1], contracted[k][1], atype
            )
        ]
        force, virial = forces_and_virial(env.force, pieces, n)
        return [
            {
                "energy": e.sum(dim=-1),
                "atom_energy": e,
                "force": f,
                "virial": v,
            }
            for (e, _), f, v in zip(parts, force.unbind(0), virial.unbind(0), strict=True)
        ]
