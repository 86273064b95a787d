"""Energy fitting: one residual MLP per centre atom type, D_i -> atomic energy (no bias here)."""

import torch
from torch import Tensor, nn

from mdtrain.model.network import FittingNet, child_seed


class EnergyFitting(nn.Module):
    """Per-type fitting nets; each net only sees the atoms of its own type."""

    ntypes: int
    dim_in: int

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
    ) -> None:
        super().__init__()
        self.ntypes = ntypes
        self.dim_in = dim_in
        self.dtype = dtype
        self.networks = nn.ModuleList(
            [
                FittingNet(dim_in, list(neuron), activation, resnet_dt, dtype, child_seed(seed, t))
                for t in range(ntypes)
            ]
        )
        for p in self.networks.parameters():
            p.requires_grad_(trainable)

    def forward(self, descriptor: Tensor, atype: Tensor) -> Tensor:
        """Atomic energies (nf, N) in float64 from D (nf, N, dim_in)."""
        nf, natoms = descriptor.shape[0], descriptor.shape[1]
        out = torch.zeros(nf, natoms, dtype=torch.float64, device=descriptor.device)
        for c, net in enumerate(self.networks):
            idx = torch.nonzero(atype == c).view(-1)
            d_c = descriptor.index_select(1, idx).reshape(-1, self.dim_in).to(self.dtype)
            e_c = net(d_c).view(nf, -1).to(torch.float64)
            out = out.index_copy(1, idx, e_c)
        return out
