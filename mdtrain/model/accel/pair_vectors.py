"""The pair vectors (``conservative.pair_vectors``) in compiled code (``csrc/pair_vectors.cpp``)
for the explicit model on the ``kernels`` backend: the same values bit for bit, one pass.

``pair_vectors`` in torch is a gather, a broadcast subtraction, a batched (P, 3) x (3, 3)
product and an addition over every pair slot of the batch: about 1 ms of CPU on one thread for
the 26,000 slots of a 192-atom water frame (the gather and the narrow product cost most), all
of it before the descriptor starts. The explicit model needs no graph through them (its forces
are explicit operations), so the kernel has no backward; inputs that require grad take the
torch operations. Chosen once, where the model is built (``ExplicitEnergyModel``).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class CompiledPairVectors:
    """``conservative.pair_vectors`` on a loaded kernel library (``Kernels.lib``)."""

    def __init__(self, lib) -> None:
        lib.mdt_pair_vectors_f64.argtypes = [_I64, _I64, _I64, *[_P] * 5, ctypes.c_int]
        self.fn = lib.mdt_pair_vectors_f64

    def __deepcopy__(self, memo):  # holds the loaded library: copies of a model share it
        return self

    def __call__(self, coord: Tensor, box: Tensor | None, nlist: Tensor, shift: Tensor) -> Tensor:
        """Neighbour-minus-centre vectors (nf, N, nnei, 3) float64 of ``coord`` (nf, N, 3)
        float64, as ``conservative.pair_vectors``; arbitrary (the vector to atom 0) in padded
        slots, as there."""
        nf, natoms, nnei = nlist.shape[0], nlist.shape[1], nlist.shape[2]
        coord, nlist = coord.contiguous(), nlist.contiguous()
        cell = None
        if box is not None:
            cell = box.contiguous()
            shift = shift.to(torch.float64).contiguous()
        out = torch.empty(nf, natoms, nnei, 3, dtype=torch.float64, device=coord.device)
        status = self.fn(
            nf * natoms, natoms, nnei, coord.data_ptr(), 0 if cell is None else cell.data_ptr(),
            nlist.data_ptr(), 0 if cell is None else shift.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"compiled pair vectors: status {status}")
        return out


def supported(coord: Tensor, box: Tensor | None, nlist: Tensor) -> bool:
    """Whether the kernel can take these inputs: CPU float64 positions and cell, int64 lists,
    and no graph asked through them (the kernel has no backward)."""
    if box is not None and (box.dtype != torch.float64 or box.requires_grad or box.is_cuda):
        return False
    return (
        coord.dtype == torch.float64
        and nlist.dtype == torch.int64
        and not coord.requires_grad
        and coord.device.type == "cpu"
        and nlist.device.type == "cpu"
    )
