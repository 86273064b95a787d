"""What the type-embedding descriptors (se_atten, se_atten_v2, se_e3_tebd) share: a type-mixed
list of ``sel`` slots, se_e2_a's environment rows, statistics buffers and exclusion rule,
and the pieces of DeePMD-kit's serialised form they have in common.
"""

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.base import Descriptor
from mdtrain.model.descriptors.layers import DenseNet, as_numpy, load
from mdtrain.model.network import dtype_of


def switch(r: Tensor, rcut_smth: float, rcut: float) -> Tensor:
    """`base.smooth_weight` with DeePMD-kit's order of operations (``u²·u·(−6u² + 15u − 10)
    + 1``). Within about 5e-5 Å of rcut the switch is ~1e-15, a cancellation whose last
    digits are rounding, and without ``smooth_type_embedding`` se_atten's attention
    direction is proportional to it (docs/type-embedding-descriptors.md): the same order
    gives the same rounding."""
    u = (torch.clamp(r, rcut_smth, rcut) - rcut_smth) / (rcut - rcut_smth)
    u2 = u * u
    return u2 * u * (-6.0 * u2 + 15.0 * u - 10.0) + 1.0


def env_rows(diff: Tensor, mask: Tensor, rcut_smth: float, rcut: float, protection: float):
    """Raw rows (…, 4) ``w/(r+p)·[1, d/(r+p)]`` and the switch ``w`` (…, 1); 0 where ~mask."""
    far = torch.full_like(diff, 2.0 * rcut)
    diff = torch.where(mask.unsqueeze(-1), diff, far)  # r > 0: finite gradients
    r = torch.linalg.vector_norm(diff, dim=-1, keepdim=True)
    w = switch(r, rcut_smth, rcut) * mask.unsqueeze(-1).to(diff.dtype)
    inv = w / (r + protection)
    return torch.cat([inv, diff * (inv / (r + protection))], dim=-1), w


class MixedTypesDescriptor(Descriptor):
    """Base of the type-mixed descriptors (``base.Descriptor`` with one list of ``sel``
    slots). Buffers ``davg``/``dstd`` (ntypes, sel, 4) float64 (DeePMD-kit's shapes),
    ``pair_keep`` (ntypes+1, ntypes+1) bool."""

    mixed_types = True
    stat_groups = ("r", "a")
    stat_columns = ((0, 1), (1, 4))
    stat_mirror = (1.0, -1.0)
    ncols = 4

    def init_mixed(
        self,
        ntypes: int,
        sel: int | list[int],
        rcut: float,
        rcut_smth: float,
        env_protection: float,
        set_davg_zero: bool,
        exclude_types: list[list[int]] | None,
        precision: str,
        where: str,
    ) -> None:
        """Set the attributes and buffers of a list of ``sum(sel)`` slots over all types."""
        total = sum(int(s) for s in sel) if isinstance(sel, (list, tuple)) else int(sel)
        if total <= 0:
            raise MDTrainError(f"{where}/sel: {sel!r} leaves no neighbour slot")
        if not 0.0 <= float(rcut_smth) < float(rcut):
            raise MDTrainError(f"{where}/rcut_smth: {rcut_smth} is not in [0, rcut = {rcut})")
        for pair in exclude_types or []:
            if len(pair) != 2 or not all(0 <= int(t) < int(ntypes) for t in pair):
                raise MDTrainError(
                    f"{where}/exclude_types: {list(pair)} is not a pair of types 0..{int(ntypes) - 1}"
                )
        self.init_common(
            ntypes, [total], rcut, rcut_smth, exclude_types, set_davg_zero, env_protection, True
        )
        self.dtype = dtype_of(precision, where)

    @classmethod
    def check_config(cls, desc: dict, ntypes: int, where: str = "model/descriptor") -> None:
        """Raise MDTrainError naming the key for a filled section it cannot build (by building
        it: the nets of these descriptors are small)."""
        cls.from_config(desc, ntypes)

    @classmethod
    def check_sel(cls, sel: Any, ntypes: int, where: str) -> None:
        """One total for the neighbours of all types: an integer, or a list that is summed."""
        values = sel if isinstance(sel, (list, tuple)) else [sel]
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in values):
            raise MDTrainError(f"{where}: expected a non-negative integer, got {sel!r}")
        if sum(values) == 0:
            raise MDTrainError(f"{where}: no neighbour slot (sel is 0)")

    @classmethod
    def config_stat_settings(cls, desc: dict, ntypes: int) -> dict[str, Any]:
        """As the base's, ``sel`` as its total (the lists hold that many slots)."""
        sel = desc["sel"]
        total = sum(int(s) for s in sel) if isinstance(sel, (list, tuple)) else int(sel)
        return super().config_stat_settings({**desc, "sel": [total]}, ntypes)

    @classmethod
    def stat_stand_in(cls, desc: dict, ntypes: int) -> "MixedTypesDescriptor":
        """A small descriptor with ``desc``'s environment sums (they depend on the cut-offs,
        exclusions and protection only): one-slot list, one-neuron nets, no attention."""
        small = {**desc, "sel": [1], "neuron": [1], "seed": None, "precision": "float64"}
        small.update({k: v for k, v in (("axis_neuron", 1), ("attn_layer", 0)) if k in desc})
        return cls.from_config(small, ntypes)

    def embedding_nets(self) -> list[nn.Module]:
        """The embedding nets (the radial or angular one, and the type net of "strip"):
        what bf16 runs under autocast. The type embedding and the attention run as built."""
        strip = getattr(self, "embedding_strip", None)
        return [self.embedding] + ([strip] if strip is not None else [])

    # --- DeePMD-kit's model file, in the registry's form
    def to_deepmd(self, cfg: dict | None = None, type_map: list[str] | None = None) -> dict:
        """DeePMD-kit's serialised descriptor dict (``cfg`` is not needed: the descriptor
        keeps its settings); ``type_map`` is written into it when given."""
        data = self.deepmd_dict()
        if type_map is not None:
            data["type_map"] = list(type_map)
            data["type_embedding"]["type_map"] = list(type_map)
        return data

    @classmethod
    def from_deepmd(cls, r: Any, d: dict, state: dict) -> dict:
        """The section of DeePMD-kit's dict ``d``; weights and statistics go to ``state``
        under ``descriptor.*`` (the registry's form; ``from_deepmd_dict`` builds it)."""
        try:
            desc = cls.from_deepmd_dict(d, "model/descriptor")
        except MDTrainError as err:  # name the file, as the reader's own refusals do
            raise MDTrainError(f"{r.source}: {err}") from err
        state.update({f"descriptor.{k}": v for k, v in desc.state_dict().items()})
        return desc.to_config()

    def env_matrix(self, diff: Tensor, mask: Tensor) -> Tensor:
        """Raw rows (nf, N, nnei, 4) from neighbour-minus-centre vectors; 0 where ~mask."""
        return env_rows(diff, mask, self.rcut_smth, self.rcut, self.env_protection)[0]

    def pair_stat_terms(self, d: Tensor) -> list[Tensor]:
        """Per pair (neighbour minus centre ``d`` (P, 3)): ``[s, s², a_x + a_y + a_z, |a|²]``
        of its raw row ``[s, a]``, what it adds to its centre's ``r``/``a`` groups (the
        padded slots add zeros; the slot count is the caller's: centres × sel)."""
        rows, _ = env_rows(
            d,
            torch.ones_like(d[:, 0], dtype=torch.bool),
            self.rcut_smth,
            self.rcut,
            self.env_protection,
        )
        s, a = rows[:, 0], rows[:, 1:]
        return [s, s * s, a.sum(dim=-1), (a * a).sum(dim=-1)]

    def normalized_rows(self, diff: Tensor, nlist: Tensor, atype: Tensor):
        """``(rr, sw, valid)``: rows ``(raw − davg)/dstd`` of the centre's type (excluded
        pairs 0, padded slots ``−davg/dstd``), the switch (…, 1) and the real, kept slots."""
        raw, sw = env_rows(
            diff.to(self.dtype), nlist >= 0, self.rcut_smth, self.rcut, self.env_protection
        )
        rr = (raw - self.davg.to(self.dtype)[atype]) / self.dstd.to(self.dtype)[atype]
        valid = nlist >= 0
        if self.has_exclusions:
            keep = self.keep_mask(nlist, atype)
            rr = rr * keep.unsqueeze(-1).to(rr.dtype)
            valid = valid & keep
            sw = sw * keep.unsqueeze(-1).to(sw.dtype)
        return rr, sw, valid

    def stats_to_deepmd(self) -> dict:
        return {
            "davg": as_numpy(self.davg.to(self.dtype)),
            "dstd": as_numpy(self.dstd.to(self.dtype)),
        }

    def stats_from_deepmd(self, variables: dict, where: str) -> None:
        load(self.davg, np.asarray(variables["davg"], dtype=np.float64), f"{where}/davg")
        load(self.dstd, np.asarray(variables["dstd"], dtype=np.float64), f"{where}/dstd")


def net_collection(net: DenseNet, ntypes: int) -> dict:
    """DeePMD-kit's ``NetworkCollection`` of one type-independent embedding net."""
    return {
        "@class": "NetworkCollection",
        "@version": 1,
        "ndim": 0,
        "ntypes": ntypes,
        "network_type": "embedding_network",
        "networks": [net.to_deepmd()],
    }


def one_net(data: dict, key: str, dtype: torch.dtype, where: str) -> DenseNet:
    """The one net of DeePMD-kit's collection ``data[key]``."""
    collection = data.get(key)
    if not isinstance(collection, dict) or len(collection.get("networks") or []) != 1:
        raise MDTrainError(f"{where}/{key}: expected one embedding network")
    if int(collection.get("ndim", 0)) != 0:
        raise MDTrainError(f"{where}/{key}: expected a type-independent network (ndim 0)")
    return DenseNet.from_deepmd(collection["networks"][0], dtype, f"{where}/{key}")


def configured_precision(data: dict, where: str) -> str:
    """The precision as configured ("default" survives in the type embedding's dict)."""
    precision = str((data.get("type_embedding") or {}).get("precision", data.get("precision")))
    if precision not in ("default", "float32", "float64"):
        raise MDTrainError(f"{where}/precision: {precision!r} is not supported")
    return precision


def refuse_unsupported(data: dict, where: str) -> None:
    """One line naming what a DeePMD-kit file holds that these descriptors cannot run."""
    for key in ("compress", "spin", "use_econf_tebd", "attn_mask"):
        if data.get(key):
            raise MDTrainError(f"{where}/{key}: not supported")
    if (data.get("env_mat") or {}).get("use_exp_switch"):
        raise MDTrainError(f"{where}/env_mat/use_exp_switch: not supported")
