"""The energy model with explicit first-order derivatives: the accelerated backends' model.

``ExplicitEnergyModel`` has the reference model's modules, parameters and buffers (so a
checkpoint does not depend on which backend wrote it) and replaces only ``forward``: energies,
forces and virials from the descriptor's explicit form (``explicit_descriptor`` for se_e2_a,
``explicit_radial`` for se_e2_r; ``FORMS``, looked up once when the model is built; a hybrid of
them: ``explicit_hybrid``) and the
fused fitting node, with the embedding work done by the ``EmbeddingOps`` it was built with. It
exists for tanh networks in float32 or float64; ``mdtrain.model.backend`` decides when it is
used.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from mdtrain.model.accel.explicit_descriptor import (
    SE_E2_A_FORM,
    EmbeddingOps,
    Environment,
    ExplicitForm,
)
from mdtrain.model.accel.explicit_radial import SE_E2_R_FORM
from mdtrain.model.accel.fitting_compiled import fitting_node_for
from mdtrain.model.accel.force_node import forces_and_virial
from mdtrain.model.accel.pair_vectors import CompiledPairVectors, supported
from mdtrain.model.conservative import pair_vectors
from mdtrain.model.energy import EnergyModel

# The descriptors with an explicit form, by type name: the ones the accelerated backends run.
FORMS: dict[str, ExplicitForm] = {"se_e2_a": SE_E2_A_FORM, "se_e2_r": SE_E2_R_FORM}


def with_pairs(form: ExplicitForm, pairs) -> ExplicitForm:
    """``form`` whose environment (and so force node) runs on the compiled pair kernels
    ``pairs`` (``pair_kernels.CompiledPairs``); None keeps the PyTorch nodes."""
    if pairs is None:
        return form
    return form._replace(environment=partial(form.environment, pairs=pairs))


class ExplicitEnergyModel(EnergyModel):
    """``EnergyModel`` whose forces and virials are explicit operations (no double backward)."""

    vectors: CompiledPairVectors | None = None  # the compiled pair vectors, when built with them
    # whether a training forward (grad enabled, training mode) computes the virial: a trainer
    # whose loss does not read it says so once (``train_outputs``); evaluation always does
    virial_in_training = True

    def __init__(self, model_config: dict, embedding: EmbeddingOps, pairs=None) -> None:
        super().__init__(model_config)
        self.embedding = embedding
        self.backend = embedding.name
        self.form = with_pairs(FORMS[self.descriptor.type_name], pairs)
        # the pair vectors in one compiled pass where the pair kernels are compiled
        self.vectors = None if pairs is None else CompiledPairVectors(pairs.lib)
        # the fitting node: compiled for a float32 fitting on the kernels, else PyTorch's
        self.fitting_node = fitting_node_for(self.fitting, getattr(embedding, "kernels", None))

    def train_outputs(self, names) -> None:
        """The outputs a training step's loss reads, said once by the trainer: without
        ``virial`` its forward skips the virial's products (``force_node.virial_of``) and
        returns no ``virial``. Evaluation (eval mode or no grad) returns every output."""
        self.virial_in_training = "virial" in names

    def pair_vectors(
        self, coord: Tensor, box: Tensor | None, nlist: Tensor, shift: Tensor
    ) -> Tensor:
        """As ``ConservativeModel.pair_vectors`` (the same values); compiled where the model
        was built with the pair kernels and no graph is asked through the positions."""
        if self.vectors is not None and supported(coord, box, nlist):
            return self.vectors(coord, box, nlist, shift)
        return pair_vectors(coord, box, nlist, shift)

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
            return self._evaluate(coord, atype, box, nlist, shift, self.virial_in_training)
        with torch.no_grad():
            return self._evaluate(coord, atype, box, nlist, shift)

    def _evaluate(
        self,
        coord: Tensor,
        atype: Tensor,
        box: Tensor | None,
        nlist: Tensor,
        shift: Tensor,
        virial: bool = True,
    ) -> dict[str, Tensor]:
        """Energy, forces and virial with dE/d(pair vector) written as explicit operations.

        The derivative is an ordinary first-order function of the parameters: a force loss
        trains without any double backward, and the pair vectors never need a graph. Forces
        gather ``g = dE/dd`` over the pairs (``d = r_j − r_i + shift``): ``F_i = Σ_j g_ij −
        Σ_(k,j)→i g_kj``; ``virial = −Σ g ⊗ d`` (the force node, ``force_node``).
        """
        x = coord.detach().to(torch.float64)
        cell: Tensor | None = None
        if box is not None:
            cell = box.detach().to(torch.float64)
        diff = self.pair_vectors(x, cell, nlist, shift)
        env = self.form.environment(self.descriptor, diff, nlist, atype)
        return self.evaluate_environment(env, diff, nlist, atype, virial)

    def evaluate_environment(
        self, env: Environment, diff: Tensor, nlist: Tensor, atype: Tensor, virial: bool = True
    ) -> dict[str, Tensor]:
        """``_evaluate`` from the pair vectors ``diff`` and their environment (computed by
        ``form.environment`` with statistics equal to this model's); ``virial`` False: no
        ``virial`` output (nor its products)."""
        atom_energy, rbar = self.energy_and_row_grad(env, atype)
        force, vir = forces_and_virial(env.force, rbar, virial=virial)
        nf, natoms = nlist.shape[0], nlist.shape[1]
        out = {
            "energy": atom_energy.sum(dim=-1),
            "atom_energy": atom_energy,
            "force": force.view(nf, natoms, 3),
        }
        if vir is not None:
            out["virial"] = vir.view(nf, 3, 3)
        return out

    def energy_and_row_grad(self, env: Environment, atype: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Atomic energies (nf, N) float64 and dE/dR̃ of each group of rows (B, nnei, 4 for
        se_e2_a, 1 for se_e2_r): everything this model's own networks compute on an
        environment (a committee shares the rest)."""
        plan = env.force.plan
        nf, natoms = plan.nf, plan.natoms
        descriptor, cache = self.form.contract(self.descriptor, self.embedding, env, nf, natoms)
        atom_energy, grad = self.fitting_node(self.fitting, descriptor, atype)
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
