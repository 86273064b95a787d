"""The se_e2_r descriptor with its derivative written out, on se_e2_a's embedding nodes.

The reference (``mdtrain.model.descriptors.se_e2_r``) gives ``D = 0.2 · Σ_j G(s̃_j) / nnei``;
forces then need a double backward through every embedding net. Here each slot gets the row
``R̃ = [s̃, 1]``: the embedding contraction ``T = Σ_j R̃_jᵀ G(s̃_j)`` of se_e2_a (the same
autograd nodes and compiled kernels, for rows of two components) holds ``Σ_j G(s̃_j)`` in its
second row, so ``D = 0.2 · T[1] / nnei``, and the nodes' row gradient of the first column is
``dE/ds̃ = G'(s̃) · dE/dT[1]`` (``dE/dT[0]`` is zero). The pull-back to the pair vector is
``dE/dd = d · dE/ds · (w'/rp − s/rp) / r`` (``s = w/rp``, ``rp = r + env_protection``), so a
force loss trains with one first-order backward, as for se_e2_a.

Padded slots (``s̃ = −davg/dstd``) and excluded pairs (``s̃ = 0``) keep the weight 1 in the
second column: they feed the nets as in the reference; their scale (the pull-back) is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mdtrain.model.accel.environment_node import RowKind
from mdtrain.model.accel.explicit_descriptor import (
    EmbeddingOps,
    Environment,
    ExplicitCache,
    ExplicitForm,
    contract_groups,
    group_row_gradients,
    kind_environment,
)
from mdtrain.model.descriptors.se_e2_r import DescriptorSeR

RESCALE = 0.2  # DeePMD-kit's res_rescale of se_e2_r (``DescriptorSeR._embed``)


def _raw_entry(far: Tensor, r: Tensor, rp: Tensor, w: Tensor, dw: Tensor):
    """The entry ``s = w/rp`` (M, nnei, 1) and the coefficient ``c`` (1, M, nnei) of
    ``ds/dd = c · d``, from pair-vector planes (3, M, nnei) and (M, nnei) distances."""
    raw = w / rp
    return raw.unsqueeze(-1), ((dw - raw) / (rp * r)).unsqueeze(0)


def pull_back_radial(qbar: Tensor, diff: Tensor, coef: Tensor) -> Tensor:
    """dE/dd (…, 3, M, nnei) from dE/ds ``qbar`` (…, 1, M, nnei)."""
    return diff * (qbar * coef)


def pull_back_radial_t(gbar: Tensor, diff: Tensor, coef: Tensor) -> Tensor:
    """The transpose of ``pull_back_radial``: a cotangent (…, 1, M, nnei) of dE/ds."""
    return (gbar * diff).sum(dim=-3, keepdim=True) * coef


SE_E2_R_ROWS = RowKind(_raw_entry, pull_back_radial, pull_back_radial_t, 1)


def _with_ones(rows: Tensor) -> Tensor:
    """Rows ``[s̃, 1]`` from ``s̃`` (…, 1)."""
    return torch.cat([rows, torch.ones_like(rows)], dim=-1)


def radial_environment(
    desc: DescriptorSeR, diff: Tensor, nlist: Tensor, atype: Tensor, pairs=None
) -> Environment:
    """Rows ``[s̃, 1]`` per group, the pull-back coefficient (M, nnei, 1) and its scale
    ``1/dstd`` (0 for excluded pairs); see the module docstring (``pairs``: as
    ``explicit_descriptor.explicit_environment``'s)."""
    return kind_environment(desc, SE_E2_R_ROWS, diff, nlist, atype, _with_ones, pairs)


def _d_of_t(tmat: Tensor) -> Tensor:
    """D (B, M) from T/nnei (B, 2, M)."""
    return tmat[:, 1] * RESCALE


def contract_radial(
    desc: DescriptorSeR, ops: EmbeddingOps, env: Environment, nf: int, natoms: int
) -> tuple[Tensor, ExplicitCache]:
    """Descriptor D (nf, N, M) on a computed environment, plus what the row gradients need."""
    return contract_groups(desc, ops, env, nf, natoms, _d_of_t)


def _tbar_of(desc: DescriptorSeR, tmat: Tensor, grad: Tensor) -> Tensor:
    """dE/dT (B, 2, M): 0 for the first row, ``0.2 · dE/dD / nnei`` for the second."""
    tbar = grad.new_zeros(tmat.shape)
    tbar[:, 1] = grad * (RESCALE / desc.nnei)
    return tbar


def radial_row_gradients(
    desc: DescriptorSeR, ops: EmbeddingOps, grad: Tensor, cache: ExplicitCache, atype: Tensor
) -> list[Tensor]:
    """dE/ds̃ (B, nnei, 1) of each group of rows from dE/dD (nf, N, M)."""
    return group_row_gradients(desc, ops, grad, cache, atype, _tbar_of, 1)


SE_E2_R_FORM = ExplicitForm(radial_environment, contract_radial, radial_row_gradients)
