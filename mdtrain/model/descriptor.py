"""The se_e2_a descriptor (DeePMD-compatible): smooth environment matrix -> embedding -> D.

For centre i and neighbour slot j, the raw row is ``w(r)·[1/r, x/r², y/r², z/r²]`` with the C²
switch ``w``; padded slots (nlist == -1) give a raw row of exactly 0. Rows are normalised by
the centre type's ``davg``/``dstd``, so a padded slot becomes ``-davg/dstd`` and still feeds
the embedding net, as in DeePMD. Excluded type pairs are zeroed after normalisation (padded
slots are never excluded). ``T = Σ_t R̃_tᵀ G_t(s_t) / sum(sel)``, ``D = Tᵀ T[:, :axis]``.
"""

import torch
from torch import Tensor, nn

from mdtrain.model.network import EmbeddingNet, child_seed


def smooth_weight(r: Tensor, rcut_smth: float, rcut: float) -> Tensor:
    """``1 - 10u³ + 15u⁴ - 6u⁵`` with ``u = (clamp(r) - rcut_smth)/(rcut - rcut_smth)``."""
    u = (torch.clamp(r, rcut_smth, rcut) - rcut_smth) / (rcut - rcut_smth)
    u3 = u * u * u
    return u3 * (-6.0 * u * u + 15.0 * u - 10.0) + 1.0


class DescriptorSeA(nn.Module):
    """se_e2_a descriptor. Buffers ``davg``/``dstd`` (ntypes, sum(sel), 4) are float64."""

    ntypes: int
    nnei: int
    sel: list[int]
    offsets: list[int]
    rcut: float
    rcut_smth: float
    env_protection: float
    axis_neuron: int
    neuron_out: int
    type_one_side: bool
    has_exclusions: bool

    def __init__(
        self,
        ntypes: int,
        sel: list[int],
        rcut: float,
        rcut_smth: float,
        neuron: list[int],
        axis_neuron: int,
        type_one_side: bool = False,
        resnet_dt: bool = False,
        activation: str = "tanh",
        dtype: torch.dtype = torch.float64,
        seed: int | None = None,
        exclude_types: list[list[int]] | None = None,
        set_davg_zero: bool = False,
        env_protection: float = 0.0,
        trainable: bool = True,
    ) -> None:
        super().__init__()
        self.ntypes = ntypes
        self.sel = [int(s) for s in sel]
        self.nnei = sum(self.sel)
        self.offsets = [sum(self.sel[:t]) for t in range(ntypes + 1)]
        self.rcut = float(rcut)
        self.rcut_smth = float(rcut_smth)
        self.env_protection = float(env_protection)
        self.axis_neuron = int(axis_neuron)
        self.neuron_out = int(neuron[-1])
        self.type_one_side = bool(type_one_side)
        self.set_davg_zero = bool(set_davg_zero)
        self.exclude_types = [sorted((int(a), int(b))) for a, b in (exclude_types or [])]
        self.dtype = dtype
        # Embedding nets: one per neighbour type, or one per (centre, neighbour) pair with flat
        # index centre + neighbour·ntypes.
        nnets = ntypes if type_one_side else ntypes * ntypes
        self.networks = nn.ModuleList(
            [
                EmbeddingNet(list(neuron), activation, resnet_dt, dtype, child_seed(seed, k))
                for k in range(nnets)
            ]
        )
        for p in self.networks.parameters():
            p.requires_grad_(trainable)
        self.register_buffer("davg", torch.zeros(ntypes, self.nnei, 4, dtype=torch.float64))
        self.register_buffer("dstd", torch.ones(ntypes, self.nnei, 4, dtype=torch.float64))
        # keep[ci, tj]: False for excluded pairs; the extra index ntypes stands for padding.
        keep = torch.ones(ntypes + 1, ntypes + 1, dtype=torch.bool)
        for a, b in self.exclude_types:
            keep[a, b] = False
            keep[b, a] = False
        self.register_buffer("pair_keep", keep, persistent=False)
        self.has_exclusions = len(self.exclude_types) > 0

    @property
    def dim_out(self) -> int:
        return self.neuron_out * self.axis_neuron

    def set_stats(self, davg: Tensor, dstd: Tensor) -> None:
        """Install statistics of shape (ntypes, nnei, 4)."""
        self.davg.copy_(torch.as_tensor(davg, dtype=torch.float64))
        self.dstd.copy_(torch.as_tensor(dstd, dtype=torch.float64))

    def keep_mask(self, nlist: Tensor, atype: Tensor) -> Tensor:
        """(nf, N, nnei) bool: False where the (centre, neighbour) type pair is excluded."""
        ntype_j = torch.where(nlist >= 0, atype[nlist.clamp(min=0)], self.ntypes)
        return self.pair_keep[atype.unsqueeze(-1), ntype_j]

    def env_matrix(self, diff: Tensor, mask: Tensor) -> Tensor:
        """Raw rows (nf, N, nnei, 4) from neighbour-minus-centre vectors; 0 where ~mask."""
        far = torch.full_like(diff, 2.0 * self.rcut)
        diff = torch.where(mask.unsqueeze(-1), diff, far)  # keeps r > 0 so gradients stay finite
        r = torch.linalg.vector_norm(diff, dim=-1, keepdim=True)
        rp = r + self.env_protection
        w = smooth_weight(r, self.rcut_smth, self.rcut) * mask.unsqueeze(-1).to(diff.dtype)
        inv = w / rp
        return torch.cat([inv, diff * (inv / rp)], dim=-1)

    def forward(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """Descriptor D (nf, N, M·axis) in the descriptor dtype.

        ``diff`` (nf, N, nnei, 3) are neighbour-minus-centre vectors (any value in padded
        slots), ``nlist`` (nf, N, nnei) with -1 padding, ``atype`` (N,).
        """
        nf, natoms = diff.shape[0], diff.shape[1]
        rr = self.normalized_rows(diff, nlist, atype)
        if self.type_one_side:
            t = self._contract(rr.view(nf * natoms, self.nnei, 4), -1)
            return self.descriptor_of_t(t / self.nnei).view(nf, natoms, self.dim_out)
        out = torch.zeros(nf, natoms, self.dim_out, dtype=rr.dtype, device=rr.device)
        for c in range(self.ntypes):
            idx = torch.nonzero(atype == c).view(-1)
            t = self._contract(rr.index_select(1, idx).reshape(-1, self.nnei, 4), c)
            d = self.descriptor_of_t(t / self.nnei)
            out = out.index_copy(1, idx, d.view(nf, -1, self.dim_out))
        return out

    def normalized_rows(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """Rows R̃ (nf, N, nnei, 4) in the descriptor dtype: ``(raw − davg)/dstd`` of the
        centre's type, 0 for excluded pairs."""
        raw = self.env_matrix(diff.to(self.dtype), nlist >= 0)
        davg_all, dstd_all = self.davg.to(self.dtype), self.dstd.to(self.dtype)
        rr = (raw - davg_all[atype]) / dstd_all[atype]
        if self.has_exclusions:
            rr = rr * self.keep_mask(nlist, atype).unsqueeze(-1).to(rr.dtype)
        return rr

    def _contract(self, rows: Tensor, centre: int) -> Tensor:
        """T (B, 4, M) = Σ_j R̃_jᵀ G(s_j) over every slot of rows (B, nnei, 4).

        ``centre`` -1: one net per neighbour type, rows of any centre type; otherwise only rows
        of that centre type and its nets ``centre + t·ntypes``.
        """
        tmat = torch.zeros(rows.shape[0], 4, self.neuron_out, dtype=rows.dtype, device=rows.device)
        for k, net in enumerate(self.networks):
            if centre < 0 or k % self.ntypes == centre:
                t = k if centre < 0 else k // self.ntypes
                block = rows[:, self.offsets[t] : self.offsets[t + 1]]  # (B, n, 4)
                g = net(block[:, :, 0].reshape(-1, 1)).view(rows.shape[0], -1, self.neuron_out)
                tmat = tmat + torch.bmm(block.transpose(1, 2), g)
        return tmat

    def descriptor_of_t(self, t: Tensor) -> Tensor:
        """T/nnei (B, 4, M) -> D (B, M·axis), flattened row-major (index m·axis + a)."""
        d = torch.matmul(t.transpose(1, 2), t[:, :, : self.axis_neuron])
        return d.reshape(t.shape[0], self.dim_out)
