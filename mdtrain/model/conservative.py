"""Forces and virials of any model that gives atomic energies from pair vectors.

A subclass defines ``atomic_energy(diff, nlist, atype, fparam, aparam) -> (nf, N)`` (the frame
and atomic parameters are None for a model without them); ``forward`` gathers the
neighbour-minus-centre vectors, applies a zero strain to them and differentiates the total
energy, as ``EnergyModel`` does (see its module docstring for the virial convention). The
combined models (``mdtrain.model.combined``) are built on it.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


def pair_vectors(coord: Tensor, box: Tensor | None, nlist: Tensor, shift: Tensor) -> Tensor:
    """Neighbour-minus-centre vectors (nf, N, nnei, 3) of ``coord`` (nf, N, 3) for ``nlist``
    (nf, N, nnei) and integer image ``shift`` (nf, N, nnei, 3); arbitrary in padded slots."""
    nf, natoms, nnei = nlist.shape[0], nlist.shape[1], nlist.shape[2]
    index = nlist.clamp(min=0).reshape(nf, natoms * nnei, 1).expand(nf, natoms * nnei, 3)
    neigh = torch.gather(coord, 1, index).view(nf, natoms, nnei, 3)
    diff = neigh - coord.unsqueeze(2)
    if box is not None:
        images = torch.bmm(shift.reshape(nf, natoms * nnei, 3).to(coord.dtype), box)
        diff = diff + images.view(nf, natoms, nnei, 3)
    return diff


class ConservativeModel(nn.Module):
    """``forward`` returns energy (nf,), atom_energy (nf, N), force (nf, N, 3) and virial
    (nf, 3, 3), float64, for the inputs of ``EnergyModel.forward``."""

    @torch.jit.unused
    def get_model_config(self) -> dict:
        """The normalised ``model`` section this model was built from (its class rebuilds it)."""
        return copy.deepcopy(self._config)

    @torch.jit.unused
    def set_out_bias(self, bias, std=None) -> None:
        """Install the per-type energy bias (ntypes,) and, optionally, its std (the subclass
        registers the ``out_bias``/``out_std`` buffers)."""
        self.out_bias.copy_(torch.as_tensor(bias, dtype=torch.float64).reshape(self.ntypes))
        if std is not None:
            self.out_std.copy_(torch.as_tensor(std, dtype=torch.float64).reshape(self.ntypes))

    def atomic_energy(
        self,
        diff: Tensor,
        nlist: Tensor,
        atype: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> Tensor:
        """Atomic energies (nf, N) float64; defined by each model."""
        raise NotImplementedError

    def pair_vectors(
        self, coord: Tensor, box: Tensor | None, nlist: Tensor, shift: Tensor
    ) -> Tensor:
        """Neighbour-minus-centre vectors (nf, N, nnei, 3); arbitrary in padded slots."""
        return pair_vectors(coord, box, nlist, shift)

    def forward(
        self,
        coord: Tensor,
        atype: Tensor,
        box: Tensor | None,
        nlist: Tensor,
        shift: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """As ``EnergyModel.forward``: a graph is kept only when grad is enabled in training;
        ``fparam`` (nf, numb_fparam) and ``aparam`` (nf, N, numb_aparam) for a model with
        frame/atomic parameters (``mdtrain.model.fitting``)."""
        grad_enabled = torch.is_grad_enabled()
        create_graph = grad_enabled and self.training
        if torch.jit.is_scripting():
            out = self._evaluate(coord, atype, box, nlist, shift, create_graph, fparam, aparam)
        else:
            with torch.enable_grad():
                out = self._evaluate(coord, atype, box, nlist, shift, create_graph, fparam, aparam)
        if not grad_enabled:
            out = {k: v.detach() for k, v in out.items()}
        return out

    def _evaluate(
        self,
        coord: Tensor,
        atype: Tensor,
        box: Tensor | None,
        nlist: Tensor,
        shift: Tensor,
        create_graph: bool,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> dict[str, Tensor]:
        x = coord.to(torch.float64)
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        strain = torch.zeros(x.shape[0], 3, 3, dtype=torch.float64, device=x.device)
        strain.requires_grad_(True)
        cell: Tensor | None = None
        if box is not None:
            cell = box.to(torch.float64)
        diff = self.pair_vectors(x, cell, nlist, shift)
        diff = diff + torch.matmul(diff, strain.unsqueeze(1))
        atom_energy = self.atomic_energy(diff, nlist, atype, fparam, aparam)
        energy = atom_energy.sum(dim=-1)
        grads = torch.autograd.grad(
            [energy.sum()],
            [x, strain],
            create_graph=create_graph,
            retain_graph=create_graph,
            allow_unused=True,  # atoms without any neighbour: the energy ignores positions
        )
        dx, dstrain = grads[0], grads[1]
        force = -dx if dx is not None else torch.zeros_like(x)
        virial = -dstrain.transpose(1, 2) if dstrain is not None else torch.zeros_like(strain)
        return {"energy": energy, "atom_energy": atom_energy, "force": force, "virial": virial}
