"""Energy fitting: a residual MLP per centre atom type, D_i -> atomic energy (no bias here).

With ``mixed_types`` (DeePMD-kit's fitting option of that name, which the model sets from its
descriptor: `mdtrain.config.shares_fitting_net`) there is ONE net, ``networks[0]``, for
all atoms: a type-mixed descriptor carries the types in D itself. The per-type energy bias
stays per type (the model's ``out_bias``).

Frame parameters (``numb_fparam``) and atomic parameters (``numb_aparam``) are appended to each
atom's descriptor row as DeePMD-kit does, after ``(x - avg) * inv_std`` with their statistics
(``fparam_avg``/``fparam_inv_std``, ``aparam_avg``/``aparam_inv_std``): the base class
`mdtrain.model.fittings.params.ParamFitting`, which the DOS and property nets share.
"""

import torch
from torch import Tensor, nn

from mdtrain.model.fittings.params import ParamFitting
from mdtrain.model.network import FittingNet, child_seed


class EnergyFitting(ParamFitting):
    """Per-type fitting nets, each seeing only the atoms of its type; or, with
    ``mixed_types``, one net for all (seeded as DeePMD-kit seeds it: its type 0's)."""

    ntypes: int
    mixed_types: bool
    dim_in: int
    dim_descrpt: int
    numb_fparam: int
    numb_aparam: int

    def __init__(
        self,
        ntypes: int,
        dim_in: int,
        neuron: list[int],
        activation: str = "tanh",
        resnet_dt: bool = True,
        dtype: torch.dtype = torch.float64,
        seed: int | None = None,
        trainable: bool = True,
        numb_fparam: int = 0,
        numb_aparam: int = 0,
        default_fparam: list[float] | None = None,
        mixed_types: bool = False,
    ) -> None:
        super().__init__()
        self.ntypes = ntypes
        self.mixed_types = bool(mixed_types)
        self.init_params(dim_in, numb_fparam, numb_aparam, default_fparam)
        self.dtype = dtype
        self.networks = nn.ModuleList(
            [
                FittingNet(
                    self.dim_in, list(neuron), activation, resnet_dt, dtype, child_seed(seed, t)
                )
                for t in range(1 if self.mixed_types else ntypes)
            ]
        )
        for p in self.networks.parameters():
            p.requires_grad_(trainable)

    def forward(
        self,
        descriptor: Tensor,
        atype: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> Tensor:
        """Atomic energies (nf, N) in float64 from D (nf, N, dim_descrpt) and the parameters."""
        descriptor = self.with_params(descriptor, fparam, aparam)
        nf, natoms = descriptor.shape[0], descriptor.shape[1]
        if self.mixed_types:
            rows = descriptor.reshape(-1, self.dim_in).to(self.dtype)
            shared = torch.empty(0, dtype=torch.float64, device=descriptor.device)
            for net in self.networks:  # the one net (TorchScript indexes no ModuleList)
                shared = net(rows).view(nf, natoms).to(torch.float64)
            return shared
        out = torch.zeros(nf, natoms, dtype=torch.float64, device=descriptor.device)
        for c, net in enumerate(self.networks):
            idx = torch.nonzero(atype == c).view(-1)
            d_c = descriptor.index_select(1, idx).reshape(-1, self.dim_in).to(self.dtype)
            e_c = net(d_c).view(nf, -1).to(torch.float64)
            out = out.index_copy(1, idx, e_c)
        return out
