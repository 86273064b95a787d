"""The energy model with explicit first-order derivatives: the accelerated backends' model.

``ExplicitEnergyModel`` has the reference model's modules, parameters and buffers (so a
checkpoint does not depend on which backend wrote it) and replaces only ``forward``: energies,
forces and virials from the descriptor's explicit form (``explicit_descriptor`` for se_e2_a,
``explicit_radial`` for se_e2_r; ``FORMS``, looked up once when the model is built) and the
fused fitting node, with the embedding work done by the ``EmbeddingOps`` it was built with. It
exists for tanh networks in float32 or float64; ``mdtrain.model.backend`` decides when it is
used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mdtrain.model.accel.explicit_descriptor import (
    SE_E2_A_FORM,
    EmbeddingOps,
    Environment,
    ExplicitForm,
)
from mdtrain.model.accel.explicit_radial import SE_E2_R_FORM
from mdtrain.model.accel.fitting_node import fitting_with_grad
from mdtrain.model.energy import EnergyModel

# The descriptors with an explicit form, by type name: the ones the accelerated backends run.
FORMS: dict[str, ExplicitForm] = {"se_e2_a": SE_E2_A_FORM, "se_e2_r": SE_E2_R_FORM}


class ExplicitEnergyModel(EnergyModel):
    """``EnergyModel`` whose forces and virials are explicit operations (no double backward)."""

    def __init__(self, model_config: dict, embedding: EmbeddingOps) -> None:
        super().__init__(model_config)
        self.embedding = embedding
        self.backend = embedding.name
        self.form = FORMS[self.descriptor.type_name]

    def forward(
        self,
        coord: Tensor,
        atype: Tensor,
        box: Tensor | None,
        nlist: Tensor,
        shift: Tensor,
    ) -> dict[str, Tensor]:
        """As ``EnergyModel.forward``; a graph (for a loss on any output) is built only when
        training with grad enabled."""
        if torch.is_grad_enabled() and self.training:
            return self._evaluate(coord, atype, box, nlist, shift)
        with torch.no_grad():
            return self._evaluate(coord, atype, box, nlist, shift)

    def _evaluate(
        self,
        coord: Tensor,
        atype: Tensor,
        box: Tensor | None,
        nlist: Tensor,
        shift: Tensor,
    ) -> dict[str, Tensor]:
        """Energy, forces and virial with dE/d(pair vector) written as explicit operations.

        The derivative is an ordinary first-order function of the parameters: a force loss
        trains without any double backward, and the pair vectors never need a graph. Forces
        gather ``g = dE/dd`` over the pairs (``d = r_j − r_i + shift``): ``F_i = Σ_j g_ij −
        Σ_(k,j)→i g_kj``; ``virial = −Σ g ⊗ d``.
        """
        x = coord.detach().to(torch.float64)
        cell: Tensor | None = None
        if box is not None:
            cell = box.detach().to(torch.float64)
        diff = self.pair_vectors(x, cell, nlist, shift)
        env = self.form.environment(self.descriptor, diff, nlist, atype)
        return self.evaluate_environment(env, diff, nlist, atype)

    def evaluate_environment(
        self, env: Environment, diff: Tensor, nlist: Tensor, atype: Tensor
    ) -> dict[str, Tensor]:
        """``_evaluate`` from the pair vectors ``diff`` and their environment (computed by
        ``form.environment`` with statistics equal to this model's)."""
        atom_energy, rbar = self.energy_and_row_grad(env, atype)
        g = self.form.pull_back(rbar * env.scale, env.diff, env.coef).to(torch.float64)
        return explicit_outputs(atom_energy, g, diff, nlist)

    def energy_and_row_grad(self, env: Environment, atype: Tensor) -> tuple[Tensor, Tensor]:
        """Atomic energies (nf, N) float64 and dE/dR̃ (nf, N, nnei, 4 for se_e2_a, 1 for
        se_e2_r): everything this model's own networks compute on an environment (a committee
        shares the rest)."""
        nf, natoms = env.diff.shape[0], env.diff.shape[1]
        descriptor, cache = self.form.contract(self.descriptor, self.embedding, env, nf, natoms)
        atom_energy, grad = fitting_with_grad(self.fitting, descriptor, atype)
        atom_energy, grad = self.biased(atom_energy, grad, atype)
        return atom_energy, self.form.row_gradients(
            self.descriptor, self.embedding, grad, cache, atype
        )

    def biased(self, atom_energy: Tensor, grad: Tensor, atype: Tensor) -> tuple[Tensor, Tensor]:
        """The fitting net's atomic energies (nf, N) and dE/dD with the energy bias added and
        the excluded atom types (``atom_exclude_types``) set to zero."""
        atom_energy = atom_energy + self.out_bias[atype]
        if self.has_atom_exclusions:
            keep = self.atom_keep[atype]
            atom_energy = atom_energy * keep
            grad = grad * keep.to(grad.dtype).view(1, -1, 1)
        return atom_energy, grad


def explicit_outputs(
    atom_energy: Tensor, g: Tensor, diff: Tensor, nlist: Tensor
) -> dict[str, Tensor]:
    """Energy, forces and virial from atomic energies (nf, N) and ``g = dE/dd`` (nf, N,
    nnei, 3) over the pairs (``d = r_j − r_i + shift``): ``F_i = Σ_j g_ij − Σ_(k,j)→i g_kj``;
    ``virial = −Σ g ⊗ d``. A committee passes its members as extra frames."""
    nf, natoms, nnei = nlist.shape[0], nlist.shape[1], nlist.shape[2]
    frame = torch.arange(nf, device=nlist.device).view(nf, 1) * natoms
    target = (nlist.clamp(min=0).view(nf, -1) + frame).view(-1)
    pulled = torch.zeros(nf * natoms, 3, dtype=torch.float64, device=g.device)
    pulled = pulled.index_add(0, target, g.reshape(-1, 3))
    force = g.sum(dim=2) - pulled.view(nf, natoms, 3)
    virial = -torch.bmm(
        g.reshape(nf, natoms * nnei, 3).transpose(1, 2), diff.reshape(nf, natoms * nnei, 3)
    )
    energy = atom_energy.sum(dim=-1)
    return {"energy": energy, "atom_energy": atom_energy, "force": force, "virial": virial}
