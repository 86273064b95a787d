"""Per-type fitting nets with several outputs, as DeePMD-kit's ``GeneralFitting`` runs them.

Atom ``i`` of type ``t`` gets ``net_t(D_i) + bias_atom_e[t]`` (``n_out`` values), and zero
when ``t`` is excluded (``exclude_types``): the common part of the dipole and polar fittings
(and of any fitting of several outputs per atom). With ``mixed_types`` (DeePMD-kit's option,
set from the descriptor: `mdtrain.config.shares_fitting_net`) one net serves every type,
``net(D_i) + bias_atom_e[t]``: the bias stays per type.
"""

import torch
from torch import Tensor, nn

from mdtrain.model.fittings.params import ParamFitting
from mdtrain.model.network import ResidualLayer, child_seed, hidden_layers


class OutputNet(nn.Module):
    """Residual hidden layers then a linear layer of ``n_out`` outputs (rows, n_in) -> (rows,
    n_out); the layer rules are `mdtrain.model.network.ResidualLayer`'s (DeePMD-kit's)."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        neuron: list[int],
        activation: str,
        resnet_dt: bool,
        dtype: torch.dtype,
        seed: int | None,
    ) -> None:
        super().__init__()
        layers = hidden_layers(n_in, neuron, activation, resnet_dt, dtype, seed)
        out_seed = child_seed(seed, len(neuron))
        last = neuron[-1] if neuron else n_in
        layers.append(ResidualLayer(last, n_out, "linear", False, False, dtype, out_seed))
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TypeFittingNets(ParamFitting):
    """One `OutputNet` per atom type (``mixed_types``: one for all, ``networks[0]``); buffer
    ``bias_atom_e`` (ntypes, n_out) float64. Frame and atomic parameters (`ParamFitting`:
    ``numb_fparam``, ``numb_aparam``) are appended to the descriptor rows, as DeePMD-kit's
    DOS and property fittings take them; ``dim_in`` counts them, ``dim_descrpt`` not."""

    ntypes: int
    mixed_types: bool
    n_out: int

    def __init__(
        self,
        ntypes: int,
        dim_in: int,
        n_out: int,
        neuron: list[int],
        activation: str = "tanh",
        resnet_dt: bool = True,
        dtype: torch.dtype = torch.float64,
        seed: int | None = None,
        exclude_types: list[int] | None = None,
        mixed_types: bool = False,
        numb_fparam: int = 0,
        numb_aparam: int = 0,
        default_fparam: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.ntypes, self.n_out = ntypes, n_out
        self.init_params(dim_in, numb_fparam, numb_aparam, default_fparam)
        self.mixed_types = bool(mixed_types)
        self.dtype = dtype
        self.networks = nn.ModuleList(
            [
                OutputNet(
                    self.dim_in,
                    n_out,
                    list(neuron),
                    activation,
                    resnet_dt,
                    dtype,
                    child_seed(seed, t),
                )
                for t in range(1 if self.mixed_types else ntypes)
            ]
        )
        self.register_buffer("bias_atom_e", torch.zeros(ntypes, n_out, dtype=torch.float64))
        keep = torch.ones(ntypes, dtype=dtype)
        for t in exclude_types or []:
            keep[int(t)] = 0.0
        self.register_buffer("type_keep", keep, persistent=False)

    def forward(
        self,
        descriptor: Tensor,
        atype: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> Tensor:
        """(nf, N, n_out) in the fitting dtype from D (nf, N, dim_descrpt) and the
        parameters."""
        nf, natoms = descriptor.shape[0], descriptor.shape[1]
        x = self.with_params(descriptor, fparam, aparam).to(self.dtype)
        out = torch.zeros(nf, natoms, self.n_out, dtype=self.dtype, device=descriptor.device)
        if self.mixed_types:
            for net in self.networks:  # the one net (TorchScript indexes no ModuleList)
                out = net(x.reshape(-1, self.dim_in)).view(nf, natoms, self.n_out)
        else:
            for c, net in enumerate(self.networks):
                idx = torch.nonzero(atype == c).view(-1)
                y = net(x.index_select(1, idx).reshape(-1, self.dim_in))
                out = out.index_copy(1, idx, y.view(nf, -1, self.n_out))
        out = out + self.bias_atom_e.to(self.dtype)[atype]
        return out * self.type_keep[atype].unsqueeze(-1)
