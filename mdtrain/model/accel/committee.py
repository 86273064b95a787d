"""The committee on the explicit-derivative backends: what depends on the frames only is
computed once for all members.

Members of a committee differ in their network weights only (``mdtrain.model.committee``):
the pair vectors, the environment matrix with its derivative coefficients, the normalised rows
(the same davg/dstd for every member) and the slot widths the embedding evaluates are one
`Environment`, computed once per batch; each member then runs its own networks on it
(``ExplicitEnergyModel.evaluate_environment``), exactly as it would alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mdtrain.model.accel.explicit import ExplicitEnergyModel
from mdtrain.model.accel.explicit_descriptor import explicit_environment
from mdtrain.model.committee import Committee


class ExplicitCommittee(Committee):
    """A committee of ``ExplicitEnergyModel`` members of one backend that share their
    descriptor statistics (checked by the caller with ``stats_shared`` once they are set)."""

    def __init__(self, members: list[ExplicitEnergyModel]) -> None:
        kinds = {type(m.embedding) for m in members}
        if not all(isinstance(m, ExplicitEnergyModel) for m in members) or len(kinds) != 1:
            raise ValueError("an explicit committee needs explicit members of one backend")
        super().__init__(list(members))

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
        first = self.members[0]
        x = coord.detach().to(torch.float64)
        cell = None if box is None else box.detach().to(torch.float64)
        diff = first.pair_vectors(x, cell, nlist, shift)
        env = explicit_environment(first.descriptor, diff, nlist, atype)
        return [m.evaluate_environment(env, diff, nlist, atype) for m in self.members]
