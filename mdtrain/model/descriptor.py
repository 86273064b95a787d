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
    skip_padded: bool
    linearize: bool

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
        self.skip_padded = True
        self.linearize = True

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
        mask = nlist >= 0
        raw = self.env_matrix(diff.to(self.dtype), mask)
        davg_all, dstd_all = self.davg.to(self.dtype), self.dstd.to(self.dtype)
        rr = (raw - davg_all[atype]) / dstd_all[atype]
        if self.has_exclusions:
            rr = rr * self.keep_mask(nlist, atype).unsqueeze(-1).to(rr.dtype)
        pad = -davg_all / dstd_all  # normalised rows of padded slots, per centre type
        if self.type_one_side:
            types = atype.repeat(nf)
            t = self._contract(
                rr.view(nf * natoms, self.nnei, 4), mask.view(-1, self.nnei), pad, types, -1
            )
            return self._descriptor(t).view(nf, natoms, self.dim_out)
        out = torch.zeros(nf, natoms, self.dim_out, dtype=rr.dtype, device=rr.device)
        for c in range(self.ntypes):
            idx = torch.nonzero(atype == c).view(-1)
            rr_c = rr.index_select(1, idx).reshape(-1, self.nnei, 4)
            mask_c = mask.index_select(1, idx).reshape(-1, self.nnei)
            t = self._contract(rr_c, mask_c, pad, None, c)
            out = out.index_copy(1, idx, self._descriptor(t).view(nf, -1, self.dim_out))
        return out

    def _contract(
        self, rr: Tensor, mask: Tensor, pad: Tensor, types: Tensor | None, centre: int
    ) -> Tensor:
        """T (B, 4, M) = Σ_t R̃_tᵀ G(s_t) for rows rr (B, nnei, 4).

        ``centre`` -1: one net per neighbour type, rows of any centre type (``types`` (B,));
        otherwise only rows of that centre type and nets ``centre + t·ntypes``.
        With ``skip_padded``, the net runs only on the leading columns of each block that
        hold a real neighbour for some row; the trailing columns are padded for every row,
        so their sum is computed once per centre type from the padded rows ``pad``
        (ntypes, nnei, 4) and added: the same numbers, up to summation order.
        """
        nrows = rr.shape[0]
        rr_cols = rr.transpose(1, 2).contiguous()  # (B, 4, nnei): blocks are plain bmm operands
        tmat = torch.zeros(nrows, 4, self.neuron_out, dtype=rr.dtype, device=rr.device)
        for k, net in enumerate(self.networks):
            t = k if centre < 0 else k // self.ntypes
            lo, hi = self.offsets[t], self.offsets[t + 1]
            mine = centre < 0 or k % self.ntypes == centre
            n = hi - lo if mine else 0
            if self.skip_padded and n > 0:
                used = torch.nonzero(mask[:, lo:hi].any(dim=0))
                n = int(used.max()) + 1 if used.numel() > 0 else 0
            if n > 0:
                rr_t = rr_cols[:, :, lo : lo + n]
                s = rr_t[:, 0].reshape(-1, 1)
                if self.linearize and net.has_tangent and s.requires_grad:
                    # g + dg·(s − s̄), s̄ = s detached: the value of G and the derivative dG/ds,
                    # but autograd reaches s only through the explicit dg, so forces never
                    # backpropagate through the net and training never double-backpropagates.
                    fixed = s.detach()
                    g, dg = net.value_and_derivative(fixed)
                    g = torch.addcmul(g, dg, s - fixed)
                else:
                    g = net(s)
                g = g.view(nrows, n, self.neuron_out)
                tmat = tmat + torch.bmm(rr_t, g)
            if mine and lo + n < hi:
                first, last = (centre, centre + 1) if centre >= 0 else (0, self.ntypes)
                rows = pad[first:last, lo + n : hi]
                g = net(rows[:, :, 0].reshape(-1, 1)).view(rows.shape[0], hi - lo - n, -1)
                tail = torch.matmul(rows.transpose(1, 2), g)  # (ntypes or 1, 4, M)
                tmat = tmat + (tail[types] if types is not None else tail)
        return tmat

    def _descriptor(self, tmat: Tensor) -> Tensor:
        """T (B, 4, M) -> D (B, M·axis), flattened row-major (index m·axis + a)."""
        tmat = tmat / self.nnei
        d = torch.matmul(tmat.transpose(1, 2), tmat[:, :, : self.axis_neuron])
        return d.reshape(tmat.shape[0], self.dim_out)
