"""The dipole fitting (DeePMD-kit's ``DipoleFitting``): ``mu_i = M_i gr_i``.

The nets give ``M_i`` (``embedding_width`` values, the descriptor's ``neuron[-1]``); the
rotation matrix ``gr_i`` (embedding_width x 3) turns with the frame, so a rotated frame gives
the rotated dipole. DeePMD-kit applies no output bias to dipoles.
"""

import torch
from torch import Tensor, nn

from mdtrain.model.fittings.nets import TypeFittingNets


class DipoleFitting(nn.Module):
    """Atomic dipoles (nf, N, 3) float64 from D and gr."""

    embedding_width: int
    tensor_size: int = 3

    def __init__(self, nets: TypeFittingNets, embedding_width: int) -> None:
        super().__init__()
        if nets.n_out != embedding_width:
            raise ValueError(f"dipole nets give {nets.n_out} values, need {embedding_width}")
        self.nets = nets
        self.embedding_width = embedding_width

    def forward(self, descriptor: Tensor, gr: Tensor, atype: Tensor, out_bias: Tensor) -> Tensor:
        """``out_bias`` (ntypes, 3): the model's output bias, unused (as in DeePMD-kit); taken
        so that both tensor fittings are called alike (a TorchScript model cannot branch on
        its fitting's class)."""
        nf, natoms = descriptor.shape[0], descriptor.shape[1]
        m = self.nets(descriptor, atype).view(nf * natoms, 1, self.embedding_width)
        rot = gr.to(m.dtype).reshape(nf * natoms, self.embedding_width, 3)
        return torch.bmm(m, rot).view(nf, natoms, 3).to(torch.float64)
