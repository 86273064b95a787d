"""The energy model: a descriptor (``mdtrain.model.descriptors``) + per-type fitting + energy bias, with exact forces
and virials by automatic differentiation. This is the reference implementation (plain
operations, any activation, TorchScript); ``mdtrain.model.accel`` holds faster ones with the
same parameters, and ``mdtrain.model.backend.build_model`` chooses between them once.

Neighbour lists come from outside (``mdtrain.neighbors.nlist.build_nlist``); the model only
gathers positions, adds ``shift @ box`` and differentiates through that.

Virial convention (DeePMD's): ``virial[k][j] = Σ_i F_ik x_ij`` over all atoms and periodic
images, i.e. ``-Σ_pairs ∂E/∂d_k d_j`` for neighbour-minus-centre vectors d. It is obtained
from a zero strain ε applied to every pair vector, ``d' = d + d @ ε`` (the same as straining
both coordinates and cell, ``r' = r + r @ ε``, ``box' = box + box @ ε``):
``virial = -(∂E/∂ε)ᵀ``. Non-periodic frames use the same formula (there is no cell term).
"""

import copy
import json

import torch
from torch import Tensor, nn

from mdtrain.model.config import normalize_model_config
from mdtrain.model.descriptors import build_descriptor
from mdtrain.model.fitting import EnergyFitting
from mdtrain.model.network import check_activation, dtype_of


class EnergyModel(nn.Module):
    """Energy model of any registered descriptor. ``forward`` returns energy, atom_energy, force and virial."""

    type_map: list[str]
    rcut: float
    sel: list[int]
    ntypes: int
    model_config_json: str
    has_atom_exclusions: bool
    backend: str

    def __init__(self, model_config: dict) -> None:
        super().__init__()
        cfg = normalize_model_config(model_config)
        self._config = cfg
        self.model_config_json = json.dumps(cfg, sort_keys=True)
        desc, fit = cfg["descriptor"], cfg["fitting_net"]
        self.type_map = list(cfg["type_map"])
        self.ntypes = len(self.type_map)
        self.rcut = float(desc["rcut"])
        self.sel = [int(s) for s in desc["sel"]]
        self.descriptor = build_descriptor(desc, self.ntypes)
        self.fitting = EnergyFitting(
            ntypes=self.ntypes,
            dim_in=self.descriptor.dim_out,
            neuron=[int(n) for n in fit["neuron"]],
            activation=check_activation(
                fit["activation_function"], "model/fitting_net/activation_function"
            ),
            resnet_dt=bool(fit["resnet_dt"]),
            dtype=dtype_of(fit["precision"], "model/fitting_net/precision"),
            seed=fit["seed"],
            trainable=bool(fit["trainable"]),
            numb_fparam=int(fit["numb_fparam"]),
            numb_aparam=int(fit["numb_aparam"]),
            default_fparam=fit["default_fparam"],
        )
        self.register_buffer("out_bias", torch.zeros(self.ntypes, dtype=torch.float64))
        self.register_buffer("out_std", torch.ones(self.ntypes, dtype=torch.float64))
        keep = torch.ones(self.ntypes, dtype=torch.float64)
        for t in cfg["atom_exclude_types"]:
            keep[int(t)] = 0.0
        self.register_buffer("atom_keep", keep, persistent=False)
        self.has_atom_exclusions = len(cfg["atom_exclude_types"]) > 0
        self.backend = "reference"  # which implementation runs (``mdtrain.model.backend``)

    @torch.jit.unused
    def get_model_config(self) -> dict:
        """The normalised ``model`` section; ``EnergyModel(cfg)`` rebuilds this architecture."""
        return copy.deepcopy(self._config)

    @torch.jit.unused
    def set_out_bias(self, bias, std=None) -> None:
        """Install the per-type energy bias (ntypes,) and, optionally, its std."""
        self.out_bias.copy_(torch.as_tensor(bias, dtype=torch.float64).reshape(self.ntypes))
        if std is not None:
            self.out_std.copy_(torch.as_tensor(std, dtype=torch.float64).reshape(self.ntypes))

    def pair_vectors(
        self, coord: Tensor, box: Tensor | None, nlist: Tensor, shift: Tensor
    ) -> Tensor:
        """Neighbour-minus-centre vectors (nf, N, nnei, 3); arbitrary in padded slots."""
        nf, natoms, nnei = nlist.shape[0], nlist.shape[1], nlist.shape[2]
        index = nlist.clamp(min=0).reshape(nf, natoms * nnei, 1).expand(nf, natoms * nnei, 3)
        neigh = torch.gather(coord, 1, index).view(nf, natoms, nnei, 3)
        diff = neigh - coord.unsqueeze(2)
        if box is not None:
            images = torch.bmm(shift.reshape(nf, natoms * nnei, 3).to(coord.dtype), box)
            diff = diff + images.view(nf, natoms, nnei, 3)
        return diff

    def atomic_energy(
        self,
        diff: Tensor,
        nlist: Tensor,
        atype: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> Tensor:
        """Atomic energies (nf, N) float64, bias included, from pair vectors."""
        descriptor = self.descriptor(diff, nlist, atype)
        energy = self.fitting(descriptor, atype, fparam, aparam) + self.out_bias[atype]
        if self.has_atom_exclusions:
            energy = energy * self.atom_keep[atype]
        return energy

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
        """Energy (nf,), atom_energy (nf, N), force (nf, N, 3), virial (nf, 3, 3), float64.

        ``coord`` (nf, N, 3), ``atype`` (N,) int64, ``box`` (nf, 3, 3) or None, ``nlist``
        (nf, N, nnei) int64 with -1 padding, ``shift`` (nf, N, nnei, 3) integer image shifts;
        ``fparam`` (nf, numb_fparam) and ``aparam`` (nf, N, numb_aparam) when the fitting has them.
        """
        grad_enabled = torch.is_grad_enabled()
        create_graph = grad_enabled and self.training
        if torch.jit.is_scripting():
            # TorchScript cannot switch grad mode on: a scripted model must be called with grad
            # enabled (the calculator does so).
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
