"""What every descriptor gives the rest of mdtrain (the model, neighbour lists, statistics,
the stat file, ``.dp`` export and the backends), and the pieces all of them share.

A descriptor maps neighbour-minus-centre vectors to a per-atom feature ``D``. Its neighbour
list is laid out as its ``mixed_types`` says: per-type blocks ``[type0 sel[0] slots | type1
...]`` (False) or one list of ``sum(sel)`` slots over all types (True), nearest first, -1
padding. Environment statistics are the descriptor's own: it names its groups of
environment-matrix entries (``stat_groups``), says what one neighbour pair adds to each
(``pair_stat_terms``) and turns the summed groups into its ``davg``/``dstd`` buffers
(``stats_from_items``). The model owns the energy bias.
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError

STD_PROTECTION = 1e-2
STD_DEFAULT = 0.1


@dataclass
class StatItem:
    """Running count, sum and sum of squares of one group of environment-matrix entries."""

    number: float = 0.0
    sum: float = 0.0
    squared_sum: float = 0.0

    def __add__(self, other: "StatItem") -> "StatItem":
        return StatItem(
            self.number + other.number,
            self.sum + other.sum,
            self.squared_sum + other.squared_sum,
        )

    def avg(self, default: float = 0.0) -> float:
        return default if self.number == 0 else self.sum / self.number

    def std(self, default: float = STD_DEFAULT, protection: float = STD_PROTECTION) -> float:
        if self.number == 0:
            return default
        mean = self.sum / self.number
        val = math.sqrt(max(self.squared_sum / self.number - mean * mean, 0.0))
        return protection if val < protection else val

    def to_array(self) -> np.ndarray:
        return np.array([self.number, self.sum, self.squared_sum], dtype=np.float64)

    @classmethod
    def from_array(cls, arr: np.ndarray) -> "StatItem":
        number, total, squared = (float(v) for v in np.asarray(arr, dtype=np.float64).ravel())
        return cls(number, total, squared)


def smooth_weight(r: Tensor, rcut_smth: float, rcut: float) -> Tensor:
    """``1 - 10u³ + 15u⁴ - 6u⁵`` with ``u = (clamp(r) - rcut_smth)/(rcut - rcut_smth)``."""
    u = (torch.clamp(r, rcut_smth, rcut) - rcut_smth) / (rcut - rcut_smth)
    u3 = u * u * u
    return u3 * (-6.0 * u * u + 15.0 * u - 10.0) + 1.0


class Descriptor(nn.Module):
    """The interface. Subclasses set the class attributes, call ``init_common`` and implement
    ``forward``, ``env_matrix``, ``pair_stat_terms``, ``from_config`` and ``check_config``.

    Buffers ``davg``/``dstd`` (ntypes, nnei, ncols) float64, as DeePMD-kit serialises them;
    ``pair_keep`` (ntypes+1, ntypes+1) bool, False for an excluded type pair (index ntypes
    stands for padding).
    """

    members_key = None  # a descriptor made of others (hybrid): the key listing them
    gathers_stats_in_search = True  # its sums can be gathered during the neighbour search
    # --- what the registry and the schema know it by
    type_name = ""  # DeePMD-kit's type name, e.g. "se_e2_a"
    aliases = ()  # other names DeePMD-kit accepts, e.g. ("se_a",)
    defaults = {}  # DeePMD-kit 3.2's argcheck defaults
    # --- statistics: the groups of entries summed (stat file keys "<group>_<type>"), the
    # environment-matrix columns each covers, and the sign of a group's sum when a pair is
    # seen from its other end (d -> -d)
    stat_groups = ()
    stat_columns = ()
    stat_mirror = ()
    ncols = 0  # width of one environment-matrix row

    ntypes: int
    nnei: int
    sel: list[int]
    rcut: float
    rcut_smth: float
    env_protection: float
    mixed_types: bool
    has_exclusions: bool

    def init_common(
        self,
        ntypes: int,
        sel: list[int],
        rcut: float,
        rcut_smth: float,
        exclude_types: list[list[int]] | None,
        set_davg_zero: bool,
        env_protection: float,
        mixed_types: bool = False,
    ) -> None:
        """Set the attributes and buffers every descriptor has."""
        self.ntypes = int(ntypes)
        self.sel = [int(s) for s in sel]
        self.nnei = sum(self.sel)
        self.offsets = [sum(self.sel[:t]) for t in range(len(self.sel) + 1)]
        self.rcut = float(rcut)
        self.rcut_smth = float(rcut_smth)
        self.env_protection = float(env_protection)
        self.set_davg_zero = bool(set_davg_zero)
        self.mixed_types = bool(mixed_types)
        self.exclude_types = [sorted((int(a), int(b))) for a, b in (exclude_types or [])]
        shape = (self.ntypes, self.nnei, self.ncols)
        self.register_buffer("davg", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("dstd", torch.ones(shape, dtype=torch.float64))
        keep = torch.ones(self.ntypes + 1, self.ntypes + 1, dtype=torch.bool)
        for a, b in self.exclude_types:
            keep[a, b] = False
            keep[b, a] = False
        self.register_buffer("pair_keep", keep, persistent=False)
        self.has_exclusions = len(self.exclude_types) > 0

    # --- building
    @classmethod
    def check_config(cls, desc: dict, ntypes: int, where: str) -> None:
        """Raise MDTrainError (naming ``where``/key) for a filled config it cannot build."""
        raise NotImplementedError

    @classmethod
    def check_sel(cls, sel: list, ntypes: int, where: str) -> None:
        """A resolved ``sel``: one count per type (a mixed-types descriptor overrides this
        to take ``[total]``)."""
        if len(sel) != ntypes or not all(isinstance(s, int) and s >= 0 for s in sel):
            raise MDTrainError(
                f"{where}: expected {ntypes} non-negative integers (one per type_map entry), "
                f"got {sel}"
            )
        if sum(sel) == 0:
            raise MDTrainError(f"{where}: all entries are 0")

    @classmethod
    def list_cut(cls, desc: dict) -> tuple[float, list[int]]:
        """``rcut`` and ``sel`` of the neighbour list a filled section needs."""
        return float(desc["rcut"]), [int(s) for s in desc["sel"]]

    @classmethod
    def from_config(cls, desc: dict, ntypes: int) -> "Descriptor":
        """The descriptor of a checked, filled ``model.descriptor`` section."""
        raise NotImplementedError

    @property
    def dim_out(self) -> int:
        """Width of D per atom."""
        raise NotImplementedError

    def embedding_nets(self) -> list[nn.Module]:
        """The embedding nets (bf16 variants, net counts); empty when it has none."""
        return []

    # --- DeePMD-kit's model file (.dp)
    deepmd_types = ()  # the type names DeePMD-kit's serialised dicts use for it

    def to_deepmd(self, cfg: dict, type_map: list[str]) -> dict:
        """DeePMD-kit's serialised descriptor dict; ``cfg`` is the normalised section this
        descriptor was built from. Raise MDTrainError naming the key that has no .dp form."""
        raise NotImplementedError

    @classmethod
    def from_deepmd(cls, r: Any, d: dict, state: dict) -> dict:
        """The ``model.descriptor`` section of DeePMD-kit's dict ``d`` (``r`` a
        ``deepmd_nets.Reader``, whose ``fail`` names the file and key); parameters and
        buffers go into ``state`` under ``descriptor.*``."""
        raise NotImplementedError

    # --- evaluation
    def keep_mask(self, nlist: Tensor, atype: Tensor) -> Tensor:
        """(nf, N, nnei) bool: False where the (centre, neighbour) type pair is excluded."""
        ntype_j = torch.where(nlist >= 0, atype[nlist.clamp(min=0)], self.ntypes)
        return self.pair_keep[atype.unsqueeze(-1), ntype_j]

    def env_matrix(self, diff: Tensor, mask: Tensor) -> Tensor:
        """Raw rows (nf, N, nnei, ncols) from neighbour-minus-centre vectors; 0 where ~mask."""
        raise NotImplementedError

    def forward(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """D (nf, N, dim_out) in the descriptor's dtype from ``diff`` (nf, N, nnei, 3)
        (any value in padded slots), ``nlist`` (nf, N, nnei) with -1 padding, ``atype``
        (N,) model type indices."""
        raise NotImplementedError

    # --- statistics
    @classmethod
    def config_stat_settings(cls, desc: dict, ntypes: int) -> dict[str, Any]:
        """Every setting of a filled config the environment sums depend on (the stat file's
        key hashes them; a change never reuses stale entries)."""
        return {
            "type": cls.type_name,
            "ntypes": int(ntypes),
            "rcut": repr(float(desc["rcut"])),
            "rcut_smth": repr(float(desc["rcut_smth"])),
            "sel": [int(s) for s in desc["sel"]],
            "exclude_types": sorted(sorted(int(t) for t in p) for p in desc["exclude_types"]),
            "env_protection": repr(float(desc["env_protection"])),
        }

    def stat_settings(self) -> dict[str, Any]:
        """``config_stat_settings`` of the config this descriptor was built from."""
        desc = {
            "rcut": self.rcut,
            "rcut_smth": self.rcut_smth,
            "sel": self.sel,
            "exclude_types": self.exclude_types,
            "env_protection": self.env_protection,
        }
        return self.config_stat_settings(desc, self.ntypes)

    @classmethod
    def stat_stand_in(cls, desc: dict, ntypes: int) -> "Descriptor":
        """A small descriptor whose environment sums are those of ``desc`` whatever its
        ``sel`` (which the sums do not depend on): built before ``sel`` is known, to gather
        the sums during the neighbour statistics. The default suits the se_e2 family."""
        small = {**desc, "sel": [1] * ntypes, "neuron": [1], "seed": None}
        small.update(type_one_side=False, resnet_dt=False, activation_function="tanh")
        small.update(precision="float64", trainable=True)
        if "axis_neuron" in small:
            small["axis_neuron"] = 1
        return cls.from_config(small, ntypes)

    def pair_stat_terms(self, d: Tensor) -> list[Tensor]:
        """Per pair (neighbour minus centre ``d`` (P, 3) float64): for each of
        ``stat_groups``, the sum and the sum of squares of the raw entries it adds, as
        ``[sum_0, squares_0, sum_1, squares_1, ...]`` of shape (P,)."""
        raise NotImplementedError

    def set_stats(self, davg: Tensor, dstd: Tensor) -> None:
        """Install statistics of the buffers' shape (ntypes, nnei, ncols)."""
        self.davg.copy_(torch.as_tensor(davg, dtype=torch.float64))
        self.dstd.copy_(torch.as_tensor(dstd, dtype=torch.float64))

    def stats_from_items(self, items: dict[str, StatItem]) -> tuple[np.ndarray, np.ndarray]:
        """davg, dstd (ntypes, nnei, ncols) from the summed groups: the first group's mean
        (unless ``set_davg_zero``; the other groups' means are 0) and every group's
        population std, floored at 1e-2 (0.1 without data)."""
        davg = np.zeros((self.ntypes, self.nnei, self.ncols))
        dstd = np.ones((self.ntypes, self.nnei, self.ncols))
        for t in range(self.ntypes):
            for g, (name, (a, b)) in enumerate(zip(self.stat_groups, self.stat_columns)):
                item = items.get(f"{name}_{t}", StatItem())
                if g == 0 and not self.set_davg_zero:
                    davg[t, :, a:b] = item.avg()
                dstd[t, :, a:b] = item.std()
        return davg, dstd

    def stat_slots(self) -> list[float]:
        """Entries one centre adds to each group: its slots times the columns covered."""
        return [float(self.nnei * (b - a)) for a, b in self.stat_columns]

    def stat_pair_keep(self) -> Tensor:
        """(ntypes, ntypes, 1, 1 or 2·len(stat_groups)) float: 0 where a (centre, neighbour)
        type pair adds nothing to a group's sums."""
        nt = self.ntypes
        return self.pair_keep[:nt, :nt, None, None].to(torch.float64)
