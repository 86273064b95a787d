"""The se_e2_a descriptor (DeePMD-compatible): smooth environment matrix -> embedding -> D.

For centre i and neighbour slot j, the raw row is ``w(r)·[1/r, x/r², y/r², z/r²]`` with the C²
switch ``w``; padded slots (nlist == -1) give a raw row of exactly 0. Rows are normalised by
the centre type's ``davg``/``dstd``, so a padded slot becomes ``-davg/dstd`` and still feeds
the embedding net, as in DeePMD. Excluded type pairs are zeroed after normalisation (padded
slots are never excluded). ``T = Σ_t R̃_tᵀ G_t(s_t) / sum(sel)``, ``D = Tᵀ T[:, :axis]``.
"""

from typing import NamedTuple

import torch
from torch import Tensor, nn

from mdtrain.model.fused_embedding import row_grad_fused
from mdtrain.model.network import EmbeddingNet, child_seed


def smooth_weight(r: Tensor, rcut_smth: float, rcut: float) -> Tensor:
    """``1 - 10u³ + 15u⁴ - 6u⁵`` with ``u = (clamp(r) - rcut_smth)/(rcut - rcut_smth)``."""
    u = (torch.clamp(r, rcut_smth, rcut) - rcut_smth) / (rcut - rcut_smth)
    u3 = u * u * u
    return u3 * (-6.0 * u * u + 15.0 * u - 10.0) + 1.0


def smooth_weight_grad(r: Tensor, rcut_smth: float, rcut: float) -> Tensor:
    """d(smooth_weight)/dr ``= -30u²(1-u)²/(rcut - rcut_smth)``; 0 outside (rcut_smth, rcut)."""
    width = rcut - rcut_smth
    u = (torch.clamp(r, rcut_smth, rcut) - rcut_smth) / width
    v = u * (1.0 - u)
    return v * v * (-30.0 / width)


class ExplicitCache(NamedTuple):
    """What ``DescriptorSeA.backward_explicit`` needs from ``forward_explicit``.

    Blocks are the embedding-net evaluations on slot columns ``lo : lo + n`` of one group
    (group: all rows with ``type_one_side``, else the rows of one centre type).
    """

    diff: Tensor  # (nf, N, nnei, 3) pair vectors (descriptor dtype)
    coef: Tensor  # (nf, N, nnei, 3) [h, c0, c1] of ``env_matrix_and_derivative``, 0 if padded
    scale: Tensor  # (nf, N, nnei, 4) 1/dstd, times 0 for excluded pairs
    tmats: list[Tensor]  # per group: T = Σ R̃ᵀG / nnei, (B, 4, M)
    rows: list[Tensor]  # per group: normalised rows (B, nnei, 4)
    values: list[Tensor]  # per block: G (B, n, M), or (tape rows, M) with a plan
    slopes: list[Tensor]  # per block: dG/ds, same layout
    owners: list[int]  # per block: its group
    starts: list[int]  # per block: lo
    widths: list[int]  # per block: n
    plans: list[list[Tensor]]  # per block: the compiled kernels' BlockPlan, or empty


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
    has_tangent: bool
    fused_nodes: bool

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
        self.has_tangent = activation == "tanh"
        # eager only: embedding + contraction, and the row gradients, as two autograd nodes
        self.fused_nodes = True

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

    def env_matrix_and_derivative(self, diff: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``env_matrix`` and coefficients ``[h, c0, c1]`` (nf, N, nnei, 3) of its derivative.

        For the row ``[w/rp, d·h]`` (``h = w/rp²``, ``rp = r + env_protection``), a gradient
        ``q`` w.r.t. the row pulls back to ``dE/dd = d·(q₀c₀ + (q₁₂₃·d)c₁) + h·q₁₂₃`` with
        ``c₀ = (w'/rp − h)/r`` and ``c₁ = (w'/rp − 2h)/(rp·r)``; all 0 where ~mask.
        """
        far = torch.full_like(diff, 2.0 * self.rcut)
        diff = torch.where(mask.unsqueeze(-1), diff, far)
        r = torch.linalg.vector_norm(diff, dim=-1, keepdim=True)
        rp = r + self.env_protection
        keep = mask.unsqueeze(-1).to(diff.dtype)
        w = smooth_weight(r, self.rcut_smth, self.rcut) * keep
        dw = smooth_weight_grad(r, self.rcut_smth, self.rcut) * keep
        inv = w / rp
        h = inv / rp
        raw = torch.cat([inv, diff * h], dim=-1)
        slope = dw / rp
        coef = torch.cat([h, (slope - h) / r, (slope - 2.0 * h) / (rp * r)], dim=-1)
        return raw, coef

    @staticmethod
    def pull_back_rows(qbar: Tensor, diff: Tensor, coef: Tensor) -> Tensor:
        """dE/dd (…, 3) from dE/d(raw row) ``qbar`` (…, 4); see ``env_matrix_and_derivative``."""
        q_ang = qbar[..., 1:]
        h, c0, c1 = coef[..., 0:1], coef[..., 1:2], coef[..., 2:3]
        radial = qbar[..., 0:1] * c0 + (q_ang * diff).sum(dim=-1, keepdim=True) * c1
        return torch.addcmul(diff * radial, h, q_ang)

    def forward_explicit(
        self, diff: Tensor, nlist: Tensor, atype: Tensor
    ) -> tuple[Tensor, ExplicitCache]:
        """Descriptor D like ``forward``, plus what ``backward_explicit`` needs.

        The embedding net returns G and dG/ds together (``value_and_derivative``); nothing
        here needs ``diff`` to require grad. tanh embedding nets only (``has_tangent``).
        """
        nf, natoms = diff.shape[0], diff.shape[1]
        mask = nlist >= 0
        diff = diff.to(self.dtype)
        raw, coef = self.env_matrix_and_derivative(diff, mask)
        davg_all, dstd_all = self.davg.to(self.dtype), self.dstd.to(self.dtype)
        dstd = dstd_all[atype]
        rr = (raw - davg_all[atype]) / dstd
        scale = 1.0 / dstd
        if self.has_exclusions:
            keep = self.keep_mask(nlist, atype).unsqueeze(-1).to(rr.dtype)
            rr = rr * keep
            scale = scale * keep
        pad = -davg_all / dstd_all
        tmats: list[Tensor] = []
        rows_of: list[Tensor] = []
        values: list[Tensor] = []
        slopes: list[Tensor] = []
        owners: list[int] = []
        starts: list[int] = []
        widths: list[int] = []
        plans: list[list[Tensor]] = []
        scale = scale.expand_as(rr)
        if self.type_one_side:
            rows = rr.view(nf * natoms, self.nnei, 4)
            types = atype.repeat(nf)
            tmat, blocks = self._contract_explicit(rows, mask.view(-1, self.nnei), pad, types, -1)
            values, slopes, owners, starts, widths, plans = blocks
            cache = ExplicitCache(
                diff, coef, scale, [tmat], [rows], values, slopes, owners, starts, widths, plans
            )
            return self._descriptor_of_t(tmat).view(nf, natoms, self.dim_out), cache
        out = torch.zeros(nf, natoms, self.dim_out, dtype=rr.dtype, device=rr.device)
        for c in range(self.ntypes):
            idx = torch.nonzero(atype == c).view(-1)
            rows = rr.index_select(1, idx).reshape(-1, self.nnei, 4)
            mask_c = mask.index_select(1, idx).reshape(-1, self.nnei)
            tmat, (vals, slps, _, los, ns, pls) = self._contract_explicit(
                rows, mask_c, pad, None, c
            )
            out = out.index_copy(1, idx, self._descriptor_of_t(tmat).view(nf, -1, self.dim_out))
            tmats.append(tmat)
            rows_of.append(rows)
            values += vals
            slopes += slps
            owners += [c] * len(los)
            starts += los
            widths += ns
            plans += pls
        cache = ExplicitCache(
            diff, coef, scale, tmats, rows_of, values, slopes, owners, starts, widths, plans
        )
        return out, cache

    def backward_explicit(
        self, grad: Tensor, cache: ExplicitCache, nlist: Tensor, atype: Tensor
    ) -> Tensor:
        """dE/d(diff) (nf, N, nnei, 3) float64 from dE/dD ``grad`` (nf, N, M·axis).

        ``D = TᵀT<`` gives ``dT = T< dDᵀ + [T dD, 0]``; a row R̃ of a real slot enters T
        through ``R̃ᵀG(s)`` with ``s = R̃[0]``, so ``dR̃ = G dTᵀ + [R̃·(G' dTᵀ), 0, 0, 0]``.
        """
        nf, natoms = grad.shape[0], grad.shape[1]
        grad = grad.to(self.dtype)
        if self.type_one_side:
            rbar = self._row_grad(grad.reshape(nf * natoms, -1), 0, cache)
            rbar = rbar.view(nf, natoms, self.nnei, 4)
        else:
            rbar = torch.zeros(nf, natoms, self.nnei, 4, dtype=grad.dtype, device=grad.device)
            for c in range(self.ntypes):
                idx = torch.nonzero(atype == c).view(-1)
                g_c = grad.index_select(1, idx).reshape(-1, self.dim_out)
                rbar_c = self._row_grad(g_c, c, cache).view(nf, -1, self.nnei, 4)
                rbar = rbar.index_copy(1, idx, rbar_c)
        grad_diff = self.pull_back_rows(rbar * cache.scale, cache.diff, cache.coef)
        return grad_diff.to(torch.float64)

    def _row_grad(self, grad: Tensor, group: int, cache: ExplicitCache) -> Tensor:
        """dE/dR̃ (B, nnei, 4) of one group from its dE/dD (B, M·axis)."""
        t = cache.tmats[group]
        rows = cache.rows[group]
        axis = self.axis_neuron
        dd = grad.view(-1, self.neuron_out, axis)
        tbar = torch.bmm(t[:, :, :axis], dd.transpose(1, 2))
        tbar = torch.cat([tbar[:, :, :axis] + torch.bmm(t, dd), tbar[:, :, axis:]], dim=2)
        tbar = tbar / self.nnei
        tbar_t = tbar.transpose(1, 2)  # (B, M, 4)
        pieces: list[Tensor] = []
        col = 0
        for b in range(len(cache.owners)):
            if cache.owners[b] != group:
                continue
            lo, n = cache.starts[b], cache.widths[b]
            value, slope = cache.values[b], cache.slopes[b]
            if lo > col:
                pieces.append(rows.new_zeros(rows.shape[0], lo - col, 4))
            if self._fused(True):
                block = rows[:, lo : lo + n]
                pieces.append(self._row_grad_fused(tbar, value, slope, block, cache.plans[b]))
            else:
                rbar = torch.bmm(value, tbar_t)  # (B, n, 4)
                sbar = (torch.bmm(slope, tbar_t) * rows[:, lo : lo + n]).sum(-1, keepdim=True)
                pieces.append(torch.cat([rbar[:, :, :1] + sbar, rbar[:, :, 1:]], dim=2))
            col = lo + n
        if col < self.nnei:
            pieces.append(rows.new_zeros(rows.shape[0], self.nnei - col, 4))
        return torch.cat(pieces, dim=1)

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
            lo, hi, mine, n = self._block_columns(k, centre, mask)
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
            if mine and lo + n < hi:  # columns that are padding for every row
                rows = self._pad_rows(pad, lo + n, hi, centre)
                tmat = tmat + self._tail(rows, net(rows[:, :, 0].reshape(-1, 1)), types)
        return tmat

    def _contract_explicit(
        self,
        rr: Tensor,
        mask: Tensor,
        pad: Tensor,
        types: Tensor | None,
        centre: int,
    ) -> tuple[
        Tensor,
        tuple[list[Tensor], list[Tensor], list[int], list[int], list[int], list[list[Tensor]]],
    ]:
        """``_contract`` for the explicit path: T/nnei (B, 4, M) and the blocks (G, dG/ds,
        group, first column, width, plan) for ``ExplicitCache``."""
        values: list[Tensor] = []
        slopes: list[Tensor] = []
        owners: list[int] = []
        starts: list[int] = []
        widths: list[int] = []
        plans: list[list[Tensor]] = []
        nrows = rr.shape[0]
        rr_cols = rr.transpose(1, 2).contiguous()
        tmat = torch.zeros(nrows, 4, self.neuron_out, dtype=rr.dtype, device=rr.device)
        for k, net in enumerate(self.networks):
            lo, hi, mine, n = self._block_columns(k, centre, mask)
            plan: list[Tensor] = []
            if n > 0:
                rr_t = rr_cols[:, :, lo : lo + n]
                if self._fused(net.fused_backward):
                    t_k, g, dg, plan = net.embed_contract(rr_t, self._slots_used(mask, lo, n))
                    tmat = tmat + t_k
                else:
                    g, dg = net.value_and_derivative(rr_t[:, 0].reshape(-1, 1))
                    g = g.view(nrows, n, self.neuron_out)
                    dg = dg.view(nrows, n, self.neuron_out)
                    tmat = torch.baddbmm(tmat, rr_t, g)
                values.append(g)
                slopes.append(dg)
                owners.append(max(centre, 0))
                starts.append(lo)
                widths.append(n)
                plans.append(plan)
            if mine and len(plan) > 0:  # each row's own padded columns (see embed_contract)
                first = plan[4]
                start = int(first.min())
                if lo + start < hi:
                    rows = self._pad_rows(pad, lo + start, hi, centre)
                    g = net(rows[:, :, 0].reshape(-1, 1))
                    tmat = tmat + self._padded_share(rows, g, first - start, types)
            elif mine and lo + n < hi:  # columns that are padding for every row
                rows = self._pad_rows(pad, lo + n, hi, centre)
                tmat = tmat + self._tail(rows, net(rows[:, :, 0].reshape(-1, 1)), types)
        return tmat / self.nnei, (values, slopes, owners, starts, widths, plans)

    @staticmethod
    def _slots_used(mask: Tensor, lo: int, n: int) -> Tensor:
        """Per row, one past its last real slot among columns lo : lo + n."""
        col = torch.arange(1, n + 1, device=mask.device)
        return (mask[:, lo : lo + n] * col).amax(dim=1)

    def _padded_share(self, rows: Tensor, g: Tensor, first: Tensor, types: Tensor | None) -> Tensor:
        """Σ R̃ᵀG over each row's padded columns (B, 4, M), given the padded rows (types, cols,
        4) of the columns from the first one any row needs, G of them, and each row's first
        column ``first`` (B,) among them: per centre type, the terms summed from the right."""
        terms = rows.unsqueeze(-1) * g.view(rows.shape[0], rows.shape[1], 1, -1)
        suffix = torch.cat([terms.flip(1).cumsum(1).flip(1), torch.zeros_like(terms[:, :1])], 1)
        kind = types if types is not None else torch.zeros_like(first)
        return suffix[kind, first.to(kind.device)]

    def _pad_rows(self, pad: Tensor, lo: int, hi: int, centre: int) -> Tensor:
        """Normalised rows of padded slots lo:hi per centre type (one type, or all for -1)."""
        first, last = (centre, centre + 1) if centre >= 0 else (0, self.ntypes)
        return pad[first:last, lo:hi]

    def _tail(self, rows: Tensor, g: Tensor, types: Tensor | None) -> Tensor:
        """Σ R̃ᵀG over padded columns: one value per centre type, broadcast to the rows
        (``types``) or (1, 4, M) for one centre; ``g`` is G of ``rows`` flattened."""
        tail = torch.matmul(rows.transpose(1, 2), g.view(rows.shape[0], rows.shape[1], -1))
        return tail[types] if types is not None else tail

    def _block_columns(self, k: int, centre: int, mask: Tensor) -> tuple[int, int, bool, int]:
        """Slot range [lo, hi) of net ``k``'s neighbour-type block, whether the net serves
        ``centre`` (-1: every centre), and how many leading columns to embed: all of them,
        or with ``skip_padded`` those up to the last column holding a real neighbour."""
        t = k if centre < 0 else k // self.ntypes
        lo, hi = self.offsets[t], self.offsets[t + 1]
        mine = centre < 0 or k % self.ntypes == centre
        n = hi - lo if mine else 0
        if self.skip_padded and n > 0:
            used = torch.nonzero(mask[:, lo:hi].any(dim=0))
            n = int(used.max()) + 1 if used.numel() > 0 else 0
        return lo, hi, mine, n

    def _fused(self, net_allows: bool) -> bool:
        """Whether the eager-only fused autograd nodes are used (never under TorchScript)."""
        if torch.jit.is_scripting():
            return False
        return self.fused_nodes and net_allows

    @torch.jit.unused
    def _row_grad_fused(
        self, tbar: Tensor, value: Tensor, slope: Tensor, rows: Tensor, plan: list[Tensor]
    ) -> Tensor:
        return row_grad_fused(tbar, value, slope, rows.transpose(1, 2), plan)

    def _descriptor_of_t(self, t: Tensor) -> Tensor:
        """T/nnei (B, 4, M) -> D (B, M·axis)."""
        d = torch.matmul(t.transpose(1, 2), t[:, :, : self.axis_neuron])
        return d.reshape(t.shape[0], self.dim_out)

    def _descriptor(self, tmat: Tensor) -> Tensor:
        """T (B, 4, M) -> D (B, M·axis), flattened row-major (index m·axis + a)."""
        return self._descriptor_of_t(tmat / self.nnei)
