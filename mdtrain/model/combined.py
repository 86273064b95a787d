"""Models built from parts: the ``pairtab`` model, ``linear_ener`` and the DP+ZBL model.

A part gives atomic energies from pair vectors (``atomic_energy(diff, nlist, atype)``) and
says which neighbours it needs: ``rcut`` and ``sel``, per-type blocks (an ``EnergyModel``) or,
``mixed_types``, one budget ``nsel`` over all types (a pair table). The combined model asks the
data pipeline for one per-type list reaching the largest cut-off with room for every part, and
derives each part's list from it as DeePMD-kit's linear model does: the nearest neighbours
within the part's cut-off, ``sel`` of each type for a blocked part, the ``nsel`` nearest of
any type for a mixed one. Energies combine per atom, ``E_i = Σ_k w_ik E_ik + bias[t_i]``:

- ``linear_ener``: constant weights, ``"sum"`` (1 each), ``"mean"`` (1/K each) or a list;
- DP+ZBL (``use_srtab``): two parts, ``w_table = s(σ_i)`` and ``w_dp = 1 - s(σ_i)``, with
  ``σ_i = Σ_j r_ij e^{-r_ij/α} / Σ_j e^{-r_ij/α}`` (a soft minimum of the neighbour distances,
  ``α = smin_alpha``) and ``s = 1`` below ``sw_rmin``, ``-6u⁵ + 15u⁴ - 10u³ + 1`` between
  (``u = (σ - sw_rmin)/(sw_rmax - sw_rmin)``), 0 from ``sw_rmax`` on; an atom without
  neighbours gets ``s = 0``. The neighbours are those of the part with the longer list.
"""

import copy
import json

import torch
from torch import Tensor, nn

from mdtrain.model.conservative import ConservativeModel
from mdtrain.model.pair_energy import PairTableEnergy


def _is_mixed(part: nn.Module) -> bool:
    """A pair table, or a network whose descriptor takes one type-mixed list."""
    if hasattr(part, "descriptor"):
        return bool(getattr(part.descriptor, "mixed_types", False))
    return bool(getattr(part, "mixed_types", False))


def _part_sel(part: nn.Module, ntypes: int) -> list[int]:
    """Slots per type that ``part`` may need in the outer per-type list."""
    if _is_mixed(part):
        total = int(part.nsel) if hasattr(part, "nsel") else sum(int(s) for s in part.sel)
        return [total] * ntypes
    return [int(s) for s in part.sel]


class CombinedModel(ConservativeModel):
    """Parts combined per atom with weights; the weights are ``weights`` (constant) unless a
    subclass overrides ``part_weights``. Has ``EnergyModel``'s bias interface."""

    type_map: list[str]
    ntypes: int
    rcut: float
    sel: list[int]
    offsets: list[int]
    part_rcut: list[float]
    part_mixed: list[bool]
    part_nsel: list[int]
    model_config_json: str
    backend: str
    mixed_types: bool  # the outer list: per type (each part's list is derived from it)
    slot_start: list[int]
    __jit_unused_properties__ = ["descriptor", "fitting"]

    def __init__(
        self,
        parts: list[nn.Module],
        weights: list[float],
        type_map: list[str],
        config: dict,
        outer_sel: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.type_map = list(type_map)
        self.ntypes = len(type_map)
        self._config = copy.deepcopy(config)
        self.model_config_json = json.dumps(config, sort_keys=True)
        self.backend = "reference"
        self.mixed_types = False
        sels = [_part_sel(p, self.ntypes) for p in parts]
        self.sel = [max(s[t] for s in sels) for t in range(self.ntypes)]
        if outer_sel is not None:  # a smaller outer list: mixed parts read what it holds
            self.sel = [int(s) for s in outer_sel]
        self.offsets = [sum(self.sel[:t]) for t in range(self.ntypes + 1)]
        self.rcut = max(float(p.rcut) for p in parts)
        self.part_rcut = [float(p.rcut) for p in parts]
        self.part_mixed = self.part_mixed_of(parts)
        self.part_nsel = [s[0] if m else sum(s) for s, m in zip(sels, self.part_mixed)]
        slots = [  # the outer slots each blocked part reads, part after part
            [self.offsets[t] + i for t in range(self.ntypes) for i in range(sels[k][t])]
            for k in range(len(parts))
        ]
        self.slot_start = [sum(len(s) for s in slots[:k]) for k in range(len(parts) + 1)]
        flat = [i for s in slots for i in s]
        self.register_buffer("slots", torch.tensor(flat, dtype=torch.int64), persistent=False)
        self.register_buffer(
            "weights", torch.tensor(weights, dtype=torch.float64), persistent=False
        )
        self.register_buffer("out_bias", torch.zeros(self.ntypes, dtype=torch.float64))
        self.register_buffer("out_std", torch.ones(self.ntypes, dtype=torch.float64))
        # no atom_exclude_types here (refused by the builder): every type has energy
        self.register_buffer(
            "atom_keep", torch.ones(self.ntypes, dtype=torch.float64), persistent=False
        )

    @staticmethod
    def part_mixed_of(parts: list[nn.Module]) -> list[bool]:
        return [_is_mixed(p) for p in parts]

    def part_list(self, k: int, diff: Tensor, nlist: Tensor, dist: Tensor) -> tuple[Tensor, Tensor]:
        """Part ``k``'s neighbour list and pair vectors, derived from the outer list."""
        rcut = self.part_rcut[k]
        if self.part_mixed[k]:  # the nsel nearest within rcut, nearest first, -1 padded
            nsel = self.part_nsel[k]
            far = torch.where(dist < rcut, dist, torch.full_like(dist, float("inf")))
            keep = torch.topk(far, min(nsel, far.shape[-1]), dim=-1, largest=False).indices
            sub_nlist = torch.gather(nlist, -1, keep)
            sub_nlist = torch.where(torch.gather(far, -1, keep).isfinite(), sub_nlist, -1)
            sub_diff = torch.gather(diff, 2, keep.unsqueeze(-1).expand(-1, -1, -1, 3))
            if keep.shape[-1] < nsel:  # a narrower outer list (DP+ZBL): pad
                pad = nsel - keep.shape[-1]
                sub_nlist = nn.functional.pad(sub_nlist, (0, pad), value=-1.0)
                sub_diff = nn.functional.pad(sub_diff, (0, 0, 0, pad))
            return sub_diff, sub_nlist
        slots = self.slots[self.slot_start[k] : self.slot_start[k + 1]]
        sub_nlist = nlist.index_select(-1, slots)
        sub_nlist = torch.where(
            dist.index_select(-1, slots) < rcut, sub_nlist, torch.full_like(sub_nlist, -1)
        )
        return diff.index_select(2, slots), sub_nlist

    def part_weights(self, lists: list[tuple[Tensor, Tensor]], atype: Tensor) -> Tensor:
        """Weights (K, nf, N) of the parts' atomic energies."""
        nf, natoms = lists[0][1].shape[0], lists[0][1].shape[1]
        return self.weights.view(-1, 1, 1).expand(-1, nf, natoms)

    def atomic_energy(
        self,
        diff: Tensor,
        nlist: Tensor,
        atype: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> Tensor:
        """Weighted sum of the parts' atomic energies plus the bias, (nf, N) float64. Frame
        and atomic parameters go to every part, as in DeePMD-kit's linear model (a network
        part takes them when its fitting has ``numb_fparam``/``numb_aparam``; a table ignores
        them)."""
        valid = nlist >= 0
        r2 = (diff.detach() ** 2).sum(-1)
        dist = torch.where(valid, torch.sqrt(r2), torch.full_like(r2, float("inf")))
        lists = [self.part_list(k, diff, nlist, dist) for k in range(len(self.parts))]
        weights = self.part_weights(lists, atype)
        energy = torch.zeros_like(dist[..., 0])
        for k, part in enumerate(self.parts):
            sub_diff, sub_nlist = lists[k]
            atomic = part.atomic_energy(sub_diff, sub_nlist, atype, fparam, aparam)
            energy = energy + weights[k] * atomic
        return energy + self.out_bias[atype]


def zbl_switch(diff: Tensor, nlist: Tensor, sw_rmin: float, sw_rmax: float, alpha: float) -> Tensor:
    """DeePMD-kit's table weight ``s(σ_i)`` (nf, N) from one neighbour list (module docstring)."""
    valid = nlist >= 0
    r2 = (diff.to(torch.float64) ** 2).sum(-1)
    r = torch.sqrt(torch.where(valid, r2, torch.ones_like(r2)))
    e = torch.where(valid, torch.exp(-r / alpha), torch.zeros_like(r))
    den = e.sum(-1)
    has = den > 0
    sigma = (r * e).sum(-1) / torch.where(has, den, torch.ones_like(den))
    u = (sigma - sw_rmin) / (sw_rmax - sw_rmin)
    smooth = -6 * u**5 + 15 * u**4 - 10 * u**3 + 1
    coef = torch.where(sigma < sw_rmin, torch.ones_like(u), smooth)
    coef = torch.where(sigma >= sw_rmax, torch.zeros_like(u), coef)
    return torch.where(has & (sigma != 0), coef, torch.zeros_like(coef))


class ZBLModel(CombinedModel):
    """A network (part 0) and a pair table (part 1) switched by ``zbl_switch``."""

    sw_rmin: float
    sw_rmax: float
    smin_alpha: float

    def __init__(
        self,
        dp: nn.Module,
        table: PairTableEnergy,
        sw_rmin: float,
        sw_rmax: float,
        smin_alpha: float,
        type_map: list[str],
        config: dict,
    ) -> None:
        # the network's own per-type list: the table reads the same neighbours (DeePMD-kit
        # gives it the nearest sum(sel) of any type; the two differ only where a type
        # overflows its sel, where the network is truncated too)
        outer = None if _is_mixed(dp) else list(dp.sel)
        super().__init__([dp, table], [1.0, 1.0], type_map, config, outer_sel=outer)
        self.sw_rmin = float(sw_rmin)
        self.sw_rmax = float(sw_rmax)
        self.smin_alpha = float(smin_alpha)

    @property
    def descriptor(self) -> nn.Module:
        """The network's descriptor (its statistics are the model's)."""
        return self.parts[0].descriptor

    @property
    def fitting(self) -> nn.Module:
        return self.parts[0].fitting

    def part_weights(self, lists: list[tuple[Tensor, Tensor]], atype: Tensor) -> Tensor:
        """``1 - s`` for the network, ``s`` for the table, from the longer of the two lists."""
        larger = 1 if lists[1][1].shape[-1] >= lists[0][1].shape[-1] else 0
        s = zbl_switch(
            lists[larger][0], lists[larger][1], self.sw_rmin, self.sw_rmax, self.smin_alpha
        )
        return torch.stack([1 - s, s])
