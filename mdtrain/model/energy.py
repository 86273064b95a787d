"""The energy model: a descriptor (``mdtrain.model.descriptors``) + fitting (per type, or one net
for all types after a type-mixed descriptor) + energy bias, with exact forces
and virials by automatic differentiation. This is the reference implementation (plain
operations, any activation, TorchScript); ``mdtrain.model.accel`` holds faster ones with the
same parameters, and ``mdtrain.model.backend.build_model`` chooses between them once.

Neighbour lists come from outside (``mdtrain.neighbors.layout``: per type, or one type-mixed
list when ``mixed_types``); the model only
gathers positions, adds ``shift @ box`` and differentiates through that.

Virial convention (DeePMD's): ``virial[k][j] = Σ_i F_ik x_ij`` over all atoms and periodic
images, i.e. ``-Σ_pairs ∂E/∂d_k d_j`` for neighbour-minus-centre vectors d. It is obtained
from a zero strain ε applied to every pair vector, ``d' = d + d @ ε`` (the same as straining
both coordinates and cell, ``r' = r + r @ ε``, ``box' = box + box @ ε``):
``virial = -(∂E/∂ε)ᵀ``. Non-periodic frames use the same formula (there is no cell term).
"""

import json

import torch
from torch import Tensor

from mdtrain.config.mixed_types import shares_fitting_net
from mdtrain.model.config import normalize_model_config
from mdtrain.model.conservative import ConservativeModel
from mdtrain.model.descriptors import build_descriptor
from mdtrain.model.fitting import EnergyFitting
from mdtrain.model.network import check_activation, dtype_of


class EnergyModel(ConservativeModel):
    """Energy model of any registered descriptor. ``forward`` (``ConservativeModel``'s)
    returns energy, atom_energy, force and virial."""

    type_map: list[str]
    rcut: float
    sel: list[int]
    mixed_types: bool
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
        self.descriptor = build_descriptor(desc, self.ntypes)
        self.rcut = float(self.descriptor.rcut)  # the neighbour list's: a hybrid's largest
        self.sel = [int(s) for s in self.descriptor.sel]  # per type, or [total]
        # the layout of its neighbour lists (``mdtrain.neighbors.layout.list_layout``)
        self.mixed_types = bool(self.descriptor.mixed_types)
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
            mixed_types=shares_fitting_net(desc),  # DeePMD-kit's rule: one net when type-mixed
        )
        self.register_buffer("out_bias", torch.zeros(self.ntypes, dtype=torch.float64))
        self.register_buffer("out_std", torch.ones(self.ntypes, dtype=torch.float64))
        keep = torch.ones(self.ntypes, dtype=torch.float64)
        for t in cfg["atom_exclude_types"]:
            keep[int(t)] = 0.0
        self.register_buffer("atom_keep", keep, persistent=False)
        self.has_atom_exclusions = len(cfg["atom_exclude_types"]) > 0
        self.backend = "reference"  # which implementation runs (``mdtrain.model.backend``)

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
