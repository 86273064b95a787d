"""The hybrid descriptor (DeePMD-kit's ``hybrid``): a list of descriptors, each with its
own ``rcut`` and ``sel``, whose outputs are concatenated in list order.

The model builds one neighbour list, as DeePMD-kit does, at the largest member ``rcut``.
When no member is type-mixed it has per-type blocks of the element-wise largest ``sel``,
nearest first, and member m sees the first ``sel_m[t]`` slots of each type block
(``cut_index``): its nearest neighbours of each type. When a member is type-mixed (se_atten,
se_e3_tebd, ...) the hybrid is type-mixed too (DeePMD-kit's ``mixed_types()`` of a hybrid is
any member's): one list of the largest ``sum(sel_m)`` slots over all types, nearest first. A
type-mixed member takes its first ``sel_m`` slots; the per-type members take per-type blocks
drawn from that list (DeePMD-kit's ``nlist_distinguish_types``: the neighbours of each type
in the list's order, ``split_sel[t]`` of them, the element-wise largest of the per-type
members' ``sel``), then their own first ``sel_m[t]`` of each block. Either way, neighbours
beyond a member's own ``rcut`` get a switch of 0 in its environment matrix, so they count as
padding does. Statistics are the members' own: the hybrid's groups are the members' groups
suffixed by the member index (``r0``, ``a0``, ``r1``, ...), each pair's terms the members'
terms (0 beyond a member's ``rcut``), its counts each member's slots. A hybrid whose members
all have an explicit form (se_e2_a, se_e2_r) runs on the accelerated backends, each member on
its own form over the same slots (``mdtrain.model.accel.explicit_hybrid``).
"""

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.base import Descriptor, StatItem

HYBRID_DEFAULTS: dict[str, Any] = {"type": "hybrid", "list": []}


def _member_class(name: object, where: str) -> type[Descriptor]:
    from mdtrain.model.descriptors.registry import descriptor_class  # the registry holds us

    return descriptor_class(name, where)


class DescriptorHybrid(Descriptor):
    """Members' outputs concatenated (in list order); no buffers of its own."""

    type_name = "hybrid"
    aliases = ()
    defaults = HYBRID_DEFAULTS
    deepmd_types = ("hybrid",)
    members_key = "list"
    gathers_stats_in_search = False  # members' cut-offs differ from the search's
    __jit_unused_properties__ = ["davg", "dstd", "dim_emb"]

    cut_starts: list[int]
    split_sel: list[int]
    member_split: list[bool]

    def __init__(self, members: list[Descriptor]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.ntypes = members[0].ntypes
        self.mixed_types = any(m.mixed_types for m in members)
        per_type = [m for m in members if not m.mixed_types]
        # the per-type blocks drawn from a type-mixed list for the per-type members
        split = [max(m.sel[t] for m in per_type) for t in range(self.ntypes)] if per_type else []
        self.split_sel = split if self.mixed_types else []
        self.member_split = [self.mixed_types and not m.mixed_types for m in members]
        if self.mixed_types:
            self.sel = [max(m.nnei for m in members)]
        else:
            self.sel = split
        self.nnei = sum(self.sel)
        self.offsets = [sum(self.sel[:t]) for t in range(len(self.sel) + 1)]
        self.rcut = max(m.rcut for m in members)
        self.rcut_smth = min(m.rcut_smth for m in members)
        self.env_protection = 0.0
        self.set_davg_zero = False
        self.exclude_types = []
        self.has_exclusions = any(m.has_exclusions for m in members)
        index, starts = [], [0]
        for m, own in zip(members, self.member_split, strict=True):
            blocks = split if own else self.sel  # the list it is cut from
            begin = [sum(blocks[:t]) for t in range(len(blocks))]
            for t, count in enumerate(m.sel):
                index.extend(range(begin[t], begin[t] + count))
            starts.append(len(index))
        self.register_buffer("cut_index", torch.tensor(index, dtype=torch.long), persistent=False)
        self.cut_starts = starts
        dtypes = {m.dtype for m in members}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
        self.stat_groups = tuple(f"{g}{k}" for k, m in enumerate(members) for g in m.stat_groups)
        self.stat_mirror = tuple(s for m in members for s in m.stat_mirror)

    # --- building
    @classmethod
    def check_sel(cls, sel: list, ntypes: int, where: str) -> None:
        """Each member checks its own ``sel``."""

    @classmethod
    def check_config(cls, desc: dict, ntypes: int, where: str) -> None:
        if not isinstance(desc.get("list"), list) or not desc["list"]:
            raise MDTrainError(f"{where}/list: a non-empty list of descriptors is required")
        for k, member in enumerate(desc["list"]):
            kind = member.get("type", "se_e2_a") if isinstance(member, dict) else None
            member_cls = _member_class(kind, f"{where}/list[{k}]") if kind is not None else None
            if member_cls is cls:
                raise MDTrainError(f"{where}/list[{k}]/type: a hybrid cannot hold a hybrid")

    @classmethod
    def list_cut(cls, desc: dict) -> tuple[float, list[int]]:
        classes = [_member_class(m["type"], "") for m in desc["list"]]
        cuts = [c.list_cut(m) for c, m in zip(classes, desc["list"], strict=True)]
        rcut = max(c[0] for c in cuts)
        if any(getattr(c, "mixed_types", False) for c in classes):  # one type-mixed list
            return rcut, [max(sum(c[1]) for c in cuts)]
        return rcut, [max(s) for s in zip(*(c[1] for c in cuts), strict=True)]

    @classmethod
    def from_config(cls, desc: dict, ntypes: int) -> "DescriptorHybrid":
        return cls([_member_class(m["type"], "").from_config(m, ntypes) for m in desc["list"]])

    @property
    def dim_out(self) -> int:
        return sum(m.dim_out for m in self.members)

    def embedding_nets(self) -> list[nn.Module]:
        return [net for m in self.members for net in m.embedding_nets()]

    # --- .dp
    def to_deepmd(self, cfg: dict, type_map: list[str]) -> dict:
        members = []
        for k, (m, mcfg) in enumerate(zip(self.members, cfg["list"], strict=True)):
            try:
                members.append(m.to_deepmd(mcfg, type_map))
            except MDTrainError as err:
                raise MDTrainError(
                    str(err).replace("model/descriptor", f"model/descriptor/list[{k}]", 1)
                ) from None
        return {"@class": "Descriptor", "type": "hybrid", "@version": 1, "list": members}

    @classmethod
    def from_deepmd(cls, r: Any, d: dict, state: dict) -> dict:
        from mdtrain.model.descriptors.registry import deepmd_descriptor_class

        members = []
        for k, md in enumerate(r.get(d, "list", "model/descriptor")):
            member_cls = deepmd_descriptor_class(md.get("type"))
            if member_cls is None or member_cls is cls:
                raise r.fail(
                    f"model/descriptor/list/{k}/type", f"{md.get('type')!r} is not supported"
                )
            found: dict = {}
            members.append(member_cls.from_deepmd(r, md, found))
            for key, value in found.items():
                state[key.replace("descriptor.", f"descriptor.members.{k}.", 1)] = value
        return {"type": "hybrid", "list": members}

    # --- evaluation
    def forward(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """The members' D (nf, N, sum of their widths), each from its slots of the list."""
        lists = self.member_lists(diff, nlist, atype)
        out: list[Tensor] = []
        for k, member in enumerate(self.members):
            out.append(member(lists[k][0], lists[k][1], atype).to(self.dtype))
        return torch.cat(out, dim=-1)

    def forward_with_rot(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> tuple[Tensor, Tensor]:
        """``(D, gr)``: D as `forward` gives it and the members' rotation matrices stacked
        (nf, N, sum of their ``dim_emb``, 3), as DeePMD-kit's hybrid concatenates them (every
        member must have one: ``mdtrain.config.mixed_types.ROTATION_DESCRIPTORS``)."""
        lists = self.member_lists(diff, nlist, atype)
        out: list[Tensor] = []
        rot: list[Tensor] = []
        for k, member in enumerate(self.members):
            d, gr = member.forward_with_rot(lists[k][0], lists[k][1], atype)
            out.append(d.to(self.dtype))
            rot.append(gr.to(self.dtype))
        return torch.cat(out, dim=-1), torch.cat(rot, dim=-2)

    def member_lists(
        self, diff: Tensor, nlist: Tensor, atype: Tensor
    ) -> list[tuple[Tensor, Tensor]]:
        """Each member's ``(diff, nlist)``: its slots of the list, or of the per-type blocks
        drawn from it (``split_by_type``)."""
        split_diff, split_nlist = self.split_by_type(diff, nlist, atype)
        lists: list[tuple[Tensor, Tensor]] = []
        for k, split in enumerate(self.member_split):
            idx = self.cut_index[self.cut_starts[k] : self.cut_starts[k + 1]]
            own_diff, own_nlist = (split_diff, split_nlist) if split else (diff, nlist)
            lists.append((own_diff.index_select(2, idx), own_nlist.index_select(2, idx)))
        return lists

    @property
    def dim_emb(self) -> int:
        """Rows of the stacked rotation matrices (DeePMD-kit's ``get_dim_emb``)."""
        return sum(int(m.dim_emb) for m in self.members)

    def split_by_type(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> tuple[Tensor, Tensor]:
        """A type-mixed list as per-type blocks of ``split_sel`` slots (DeePMD-kit's
        ``nlist_distinguish_types``): per type, its neighbours in the list's order, then -1
        padding. The vectors follow their slots (padding: any value). Unchanged when no
        member needs it."""
        if len(self.split_sel) == 0:
            return diff, nlist
        valid = nlist >= 0
        ntype = torch.where(valid, atype[nlist.clamp(min=0)], -1)
        diffs: list[Tensor] = []
        lists: list[Tensor] = []
        for t, count in enumerate(self.split_sel):
            pick = ntype == t
            order = torch.sort((~pick).to(torch.uint8), dim=-1, stable=True)[1][..., :count]
            lists.append(torch.where(pick.gather(2, order), nlist.gather(2, order), -1))
            diffs.append(diff.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, 3)))
        return torch.cat(diffs, dim=2), torch.cat(lists, dim=2)

    # --- statistics
    @classmethod
    def config_stat_settings(cls, desc: dict, ntypes: int) -> dict[str, Any]:
        settings = [
            _member_class(m["type"], "").config_stat_settings(m, ntypes) for m in desc["list"]
        ]
        return {"type": "hybrid", "list": settings}

    def stat_settings(self) -> dict[str, Any]:
        return {"type": "hybrid", "list": [m.stat_settings() for m in self.members]}

    def pair_stat_terms(self, d: Tensor) -> list[Tensor]:
        return [term for m in self.members for term in m.pair_stat_terms(d)]

    def stat_pair_keep(self) -> Tensor:
        keep = [m.stat_pair_keep().expand(-1, -1, -1, 2 * len(m.stat_groups)) for m in self.members]
        return torch.cat(keep, dim=-1)

    def stat_slots(self) -> list[float]:
        return [s for m in self.members for s in m.stat_slots()]

    def _split(self, items: dict[str, StatItem], k: int) -> dict[str, StatItem]:
        member = self.members[k]
        return {
            f"{g}_{t}": items.get(f"{g}{k}_{t}", StatItem())
            for g in member.stat_groups
            for t in range(self.ntypes)
        }

    def stats_from_items(self, items: dict[str, StatItem]) -> tuple[np.ndarray, np.ndarray]:
        """The members' davg and dstd, flattened and concatenated (``set_stats`` splits them)."""
        parts = [m.stats_from_items(self._split(items, k)) for k, m in enumerate(self.members)]
        return (
            np.concatenate([a.ravel() for a, _ in parts]),
            np.concatenate([s.ravel() for _, s in parts]),
        )

    def set_stats(self, davg: Tensor, dstd: Tensor) -> None:
        davg, dstd = torch.as_tensor(davg).ravel(), torch.as_tensor(dstd).ravel()
        start = 0
        for m in self.members:
            n = m.davg.numel()
            m.set_stats(
                davg[start : start + n].view_as(m.davg), dstd[start : start + n].view_as(m.dstd)
            )
            start += n

    @property
    def davg(self) -> Tensor:
        return torch.cat([m.davg.ravel() for m in self.members])

    @property
    def dstd(self) -> Tensor:
        return torch.cat([m.dstd.ravel() for m in self.members])
