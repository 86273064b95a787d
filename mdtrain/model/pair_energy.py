"""Atomic energies of a tabulated pair potential, differentiable in the pair vectors.

``E_i = ½ Σ_j E_{t_i t_j}(r_ij)`` over the neighbours of i, each pair energy read from
DeePMD-kit's cubic spline table (``mdtrain.data.pair_table``): ``u = (r - rmin)/hh``, interval
``k = ⌊u⌋``, ``E = ((a3 v + a2) v + a1) v + a0`` with ``v = u - k``. A pair at or beyond ``rcut``
or beyond the (extended) table gives 0. A distance below the table's first point is refused
with the pair and the file named, as DeePMD-kit's PyTorch backend refuses it (a TorchScript
model raises a shorter message; a ``torch.export`` program, which cannot raise on values,
gives such atoms a NaN energy, which its callers report as non-finite). Forces and virials
come from autograd through ``r``.
"""

import torch
from torch import Tensor, nn

from mdtrain.data.pair_table import PairTable
from mdtrain.errors import MDTrainError


class PairTableEnergy(nn.Module):
    """A pair table as buffers (a part of ``mdtrain.model.combined``'s models): ``tab_data`` (ntypes, ntypes, nspline, 4), ``tab_vdata`` (the
    extended table, kept for DeePMD-kit's serialised form) and ``tab_info`` (rmin, hh,
    nspline, ntypes)."""

    rmin: float
    hh: float
    rcut: float
    rmax: float
    nspline: int
    ntypes: int
    nsel: int
    mixed_types: bool
    source: str
    type_map: list[str]
    raise_below: bool

    def __init__(self, table: PairTable, type_map: list[str], nsel: int) -> None:
        super().__init__()
        self.nsel = int(nsel)  # neighbours of any type it reads (DeePMD-kit's ``sel``, summed)
        self.mixed_types = True
        self.rmin = table.rmin
        self.hh = table.hh
        self.rcut = table.rcut
        self.rmax = table.rmax
        self.nspline = table.nspline
        self.ntypes = table.ntypes
        self.source = table.source
        self.type_map = list(type_map)
        # a pair below the table raises (eager, TorchScript); off only in a copy being
        # exported (`mdtrain.infer.freeze`), which cannot raise on values: NaN there
        self.raise_below = True
        # derived from the table the model config holds: not part of the state dict
        coef = torch.as_tensor(table.coef, dtype=torch.float64)
        self.register_buffer("tab_data", coef, persistent=False)
        vdata = torch.as_tensor(table.vdata, dtype=torch.float64)
        self.register_buffer("tab_vdata", vdata, persistent=False)
        info = torch.as_tensor(table.tab_info(), dtype=torch.float64)
        self.register_buffer("tab_info", info, persistent=False)

    def pair_energy(self, r: Tensor, ti: Tensor, tj: Tensor, valid: Tensor) -> Tensor:
        """Pair energies (same shape as ``r``) for centre types ``ti`` and neighbour types
        ``tj`` (broadcast to ``r``); 0 where ``valid`` is false."""
        uu = (r - self.rmin) * (1.0 / self.hh)
        uu = torch.where(valid, uu, torch.full_like(uu, float(self.nspline + 1)))
        idx = uu.detach().to(torch.int64)
        vv = uu - idx.to(uu.dtype)
        k = idx.clamp(0, self.nspline - 1)
        flat = (ti * self.ntypes + tj) * self.nspline + k
        coef = self.tab_data.reshape(-1, 4)[flat.reshape(-1)].reshape(list(flat.shape) + [4])
        a3, a2, a1, a0 = coef[..., 0], coef[..., 1], coef[..., 2], coef[..., 3]
        energy = ((a3 * vv + a2) * vv + a1) * vv + a0
        outside = (
            (r >= self.rcut) | (r >= self.rmin + self.nspline * self.hh) | (idx > self.nspline)
        )
        return torch.where(outside | ~valid, torch.zeros_like(energy), energy)

    def atomic_energy(
        self,
        diff: Tensor,
        nlist: Tensor,
        atype: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> Tensor:
        """Atomic energies (nf, N) float64 from neighbour-minus-centre vectors ``diff``
        (nf, N, nnei, 3) and the neighbour list ``nlist`` (-1 padding; any layout). A table
        takes no frame or atomic parameters: ``fparam``/``aparam`` are ignored."""
        valid = nlist >= 0
        r2 = (diff.to(torch.float64) ** 2).sum(-1)
        r = torch.sqrt(torch.where(valid, r2, torch.ones_like(r2)))
        below = valid & (r.detach() < self.rmin)
        if self.raise_below:
            if torch.jit.is_scripting():
                if bool(below.any()):
                    raise RuntimeError(
                        "pair table " + self.source + ": a pair of atoms is closer than the "
                        "table's first distance"
                    )
            else:
                self.check_range(r, below, nlist, atype)
        ti = atype.view(1, -1, 1).expand_as(nlist)
        tj = atype[nlist.clamp(min=0)]
        energy = 0.5 * self.pair_energy(r, ti, tj, valid).sum(-1)
        return torch.where(below.any(-1), torch.full_like(energy, float("nan")), energy)

    @torch.jit.unused
    def check_range(self, r: Tensor, below: Tensor, nlist: Tensor, atype: Tensor) -> None:
        """Refuse a pair closer than the table's first distance (``below``), naming it and
        the file."""
        if not bool(below.any()):
            return
        f, i, s = (int(v) for v in torch.nonzero(below)[0])
        j = int(nlist[f, i, s])
        ti, tj = self.type_map[int(atype[i])], self.type_map[int(atype[j])]
        raise MDTrainError(
            f"pair table {self.source}: atoms {i} ({ti}) and {j} ({tj}) of frame {f} are "
            f"{float(r.detach()[f, i, s]):.6g} Å apart, below the table's first distance {self.rmin:g} Å"
        )
