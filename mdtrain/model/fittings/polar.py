"""The polarizability fitting (DeePMD-kit's ``PolarFitting``): ``alpha_i = gr_iᵀ P_i gr_i``.

With ``fit_diag`` the nets give the diagonal of ``P_i`` (embedding_width values), otherwise
the whole matrix, symmetrised as ``(P + Pᵀ)/2``. ``P`` is scaled by ``scale[t]`` first; with
``shift_diag`` the isotropic ``scale[t] (constant_matrix[t] + c_t) I`` is added, where ``c_t``
is the mean of the diagonal of the model's output bias of type ``t`` (the atomic model's
``apply_out_stat``; the model passes its ``out_bias`` in).
"""

import torch
from torch import Tensor, nn

from mdtrain.model.fittings.nets import TypeFittingNets


class PolarFitting(nn.Module):
    """Atomic polarizabilities (nf, N, 9) float64 (row-major 3x3) from D and gr."""

    embedding_width: int
    fit_diag: bool
    shift_diag: bool
    tensor_size: int = 9

    def __init__(
        self,
        nets: TypeFittingNets,
        embedding_width: int,
        fit_diag: bool = True,
        shift_diag: bool = True,
        scale: list[float] | None = None,
    ) -> None:
        super().__init__()
        need = embedding_width if fit_diag else embedding_width * embedding_width
        if nets.n_out != need:
            raise ValueError(f"polar nets give {nets.n_out} values, need {need}")
        self.nets = nets
        self.embedding_width = embedding_width
        self.fit_diag = bool(fit_diag)
        self.shift_diag = bool(shift_diag)
        ntypes = nets.ntypes
        values = [1.0] * ntypes if scale is None else [float(s) for s in scale]
        self.register_buffer("scale", torch.tensor(values, dtype=torch.float64))
        self.register_buffer("constant_matrix", torch.zeros(ntypes, dtype=torch.float64))

    def forward(self, descriptor: Tensor, gr: Tensor, atype: Tensor, out_bias: Tensor) -> Tensor:
        """``out_bias`` (ntypes, 9): the model's output bias; the mean of each type's diagonal
        is its isotropic bias ``c_t``."""
        nf, natoms = descriptor.shape[0], descriptor.shape[1]
        diag_bias = out_bias.reshape(-1, 3, 3).diagonal(dim1=1, dim2=2).mean(dim=1)
        width = self.embedding_width
        out = self.nets(descriptor, atype)
        dtype = out.dtype
        scale = self.scale.to(dtype)[atype]  # (N,)
        out = out * scale.view(1, natoms, 1)
        rot = gr.to(dtype).reshape(nf * natoms, width, 3)
        if self.fit_diag:
            inner = out.reshape(nf * natoms, width, 1) * rot
        else:
            p = out.reshape(nf * natoms, width, width)
            inner = torch.bmm((p + p.transpose(1, 2)) / 2, rot)
        alpha = torch.bmm(rot.transpose(1, 2), inner).view(nf, natoms, 3, 3)
        if self.shift_diag:
            shift = (self.constant_matrix.to(dtype)[atype] + diag_bias.to(dtype)[atype]) * scale
            eye = torch.eye(3, dtype=dtype, device=alpha.device)
            alpha = alpha + shift.view(1, natoms, 1, 1) * eye
        return alpha.reshape(nf, natoms, 9).to(torch.float64)
