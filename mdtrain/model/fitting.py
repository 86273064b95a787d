"""Energy fitting: a residual MLP per centre atom type, D_i -> atomic energy (no bias here).

With ``mixed_types`` (DeePMD-kit's fitting option of that name, which the model sets from its
descriptor: `mdtrain.config.shares_fitting_net`) there is ONE net, ``networks[0]``, for
all atoms: a type-mixed descriptor carries the types in D itself. The per-type energy bias
stays per type (the model's ``out_bias``).

Frame parameters (``numb_fparam``) and atomic parameters (``numb_aparam``) are appended to each
atom's descriptor row as DeePMD-kit does, after ``(x - avg) * inv_std`` with their statistics
(``fparam_avg``/``fparam_inv_std``, ``aparam_avg``/``aparam_inv_std``). Those buffers exist
only when the model has such parameters, so a plain model keeps its state dict.
"""

import torch
from torch import Tensor, nn

from mdtrain.model.network import FittingNet, child_seed


class EnergyFitting(nn.Module):
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
        self.dim_descrpt = dim_in
        self.numb_fparam = int(numb_fparam)
        self.numb_aparam = int(numb_aparam)
        self.dim_in = dim_in + self.numb_fparam + self.numb_aparam
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
        f64 = torch.float64
        if self.numb_fparam > 0:
            self.register_buffer("fparam_avg", torch.zeros(self.numb_fparam, dtype=f64))
            self.register_buffer("fparam_inv_std", torch.ones(self.numb_fparam, dtype=f64))
            if default_fparam is not None:
                default = torch.tensor([float(v) for v in default_fparam], dtype=f64)
                # from the config, so not in the state dict (checkpoints, .dp files)
                self.register_buffer("default_fparam", default, persistent=False)
        if self.numb_aparam > 0:
            self.register_buffer("aparam_avg", torch.zeros(self.numb_aparam, dtype=f64))
            self.register_buffer("aparam_inv_std", torch.ones(self.numb_aparam, dtype=f64))

    def with_params(
        self, descriptor: Tensor, fparam: Tensor | None, aparam: Tensor | None
    ) -> Tensor:
        """D (nf, N, dim_descrpt) with the normalised frame and atomic parameters appended."""
        nf, natoms = descriptor.shape[0], descriptor.shape[1]
        parts = [descriptor]
        if hasattr(self, "fparam_avg"):
            if fparam is None:
                if hasattr(self, "default_fparam"):
                    fparam = self.default_fparam.unsqueeze(0).expand(nf, self.numb_fparam)
                else:
                    raise RuntimeError("this model needs frame parameters (fparam)")
            fp = (fparam.reshape(nf, self.numb_fparam).to(torch.float64) - self.fparam_avg) * (
                self.fparam_inv_std
            )
            fp = fp.unsqueeze(1).expand(nf, natoms, self.numb_fparam)
            parts.append(fp.to(descriptor.dtype))
        if hasattr(self, "aparam_avg"):
            if aparam is None:
                raise RuntimeError("this model needs atomic parameters (aparam)")
            ap = aparam.reshape(nf, natoms, self.numb_aparam).to(torch.float64)
            ap = (ap - self.aparam_avg) * self.aparam_inv_std
            parts.append(ap.to(descriptor.dtype))
        if len(parts) == 1:
            return descriptor
        return torch.cat(parts, dim=-1)

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
