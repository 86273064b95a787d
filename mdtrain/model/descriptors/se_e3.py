"""The se_e3 descriptor (DeePMD-kit's three-body embedding, aliases se_at, se_a_3be, se_t).

The rows are se_e2_a's, ``R̃_j = (w(r)/r·[1, d/r] − davg)/dstd`` of the centre type, with
excluded pairs zeroed; only their angular part ``a_j = R̃_j[1:4]`` is used. For each pair of
neighbour types ``ti <= tj`` the angle-like products ``g_jk = a_j·a_k`` (j in block ti, k in
block tj, padded slots included) feed the net of that type pair, and
``D = Σ_{ti<=tj} Σ_{j,k} g_jk G_{ti,tj}(g_jk) / (sel[ti]·sel[tj])``, ``neuron[-1]`` wide.
It costs one net evaluation per pair of neighbour slots (``sel²``, not ``sel``): use a small
``rcut``/``sel`` and narrow nets. DeePMD-kit keeps ntypes² nets and leaves those with
``ti > tj`` unused (zeroed in its files); mdtrain builds the used ones only.
"""

from typing import Any

import torch
from torch import Tensor, nn

from mdtrain.model.descriptors.se_deepmd import se_from_deepmd, se_to_deepmd
from mdtrain.model.descriptors.se_e2_a import (
    AngularRowsDescriptor,
    check_embedding_config,
    embedding_kwargs,
)
from mdtrain.model.export_form import recast
from mdtrain.model.network import EmbeddingNet, child_seed, residual_by_cat

SE_E3_DEFAULTS: dict[str, Any] = {
    "type": "se_e3",
    "rcut": 6.0,
    "rcut_smth": 0.5,
    "neuron": [10, 20, 40],
    "activation_function": "tanh",
    "resnet_dt": False,
    "precision": "default",
    "trainable": True,
    "seed": None,
    "set_davg_zero": False,
    "exclude_types": [],
    "env_protection": 0.0,
}


def type_pairs(ntypes: int) -> list[tuple[int, int]]:
    """The (ti, tj), ti <= tj, that have a net, in the order of DeePMD-kit's collection
    index ti + tj·ntypes."""
    return [(ti, tj) for tj in range(ntypes) for ti in range(tj + 1)]


class DescriptorSeT(AngularRowsDescriptor):
    """se_e3 descriptor. Buffers ``davg``/``dstd`` (ntypes, sum(sel), 4) are float64."""

    type_name = "se_e3"
    aliases = ("se_at", "se_a_3be", "se_t")
    defaults = SE_E3_DEFAULTS
    deepmd_types = ("se_e3", "se_at", "se_a_3be", "se_t")

    neuron_out: int
    type_one_side: bool
    first: list[int]
    second: list[int]

    def __init__(
        self,
        ntypes: int,
        sel: list[int],
        neuron: list[int],
        resnet_dt: bool = False,
        activation: str = "tanh",
        dtype: torch.dtype = torch.float64,
        seed: int | None = None,
        trainable: bool = True,
        **env: Any,
    ) -> None:
        """``env``: ``rcut``, ``rcut_smth`` and optionally ``exclude_types``,
        ``set_davg_zero``, ``env_protection`` (``Descriptor.init_common``)."""
        super().__init__()
        self.init_common(
            ntypes,
            sel,
            env["rcut"],
            env["rcut_smth"],
            env.get("exclude_types"),
            env.get("set_davg_zero", False),
            env.get("env_protection", 0.0),
        )
        self.neuron_out = int(neuron[-1])
        self.type_one_side = False  # its .dp collection is indexed by type pairs
        self.dtype = dtype
        pairs = type_pairs(self.ntypes)
        self.first = [p[0] for p in pairs]
        self.second = [p[1] for p in pairs]
        self.networks = nn.ModuleList(
            [
                EmbeddingNet(list(neuron), activation, resnet_dt, dtype, child_seed(seed, k))
                for k in range(len(pairs))
            ]
        )
        for p in self.networks.parameters():
            p.requires_grad_(trainable)

    @classmethod
    def check_config(cls, desc: dict, ntypes: int, where: str) -> None:
        check_embedding_config(desc, where)

    @classmethod
    def from_config(cls, desc: dict, ntypes: int) -> "DescriptorSeT":
        kwargs = embedding_kwargs({**desc, "type_one_side": False})
        del kwargs["type_one_side"]
        return cls(ntypes=ntypes, sel=[int(s) for s in desc["sel"]], **kwargs)

    @property
    def dim_out(self) -> int:
        return self.neuron_out

    @staticmethod
    def slots(ntypes: int) -> list[int]:
        """Our net at each DeePMD-kit collection index ti + tj·ntypes (-1: none)."""
        index = {ti + tj * ntypes: k for k, (ti, tj) in enumerate(type_pairs(ntypes))}
        return [index.get(i, -1) for i in range(ntypes * ntypes)]

    def to_deepmd(self, cfg: dict, type_map: list[str]) -> dict:
        out = se_to_deepmd(self, cfg, type_map, "se_e3", self.slots(self.ntypes))
        for key in ("type_one_side", "spin"):  # keys DeePMD-kit's se_e3 does not take
            out.pop(key)
        return out

    @classmethod
    def from_deepmd(cls, r: Any, d: dict, state: dict) -> dict:
        ntypes = len(r.get(d, "sel", "model/descriptor"))
        found = se_from_deepmd(r, d, state, 4, cls.slots(ntypes))
        found.pop("type_one_side")
        return {"type": "se_e3", **found}

    def embedding_nets(self) -> list[nn.Module]:
        return list(self.networks)

    def block_windows(self, nlist: Tensor) -> list[int]:
        """Per neighbour type, the slots the sum must see: up to the last real slot of any
        centre in the batch, all ``sel`` where the padded rows ``−davg/dstd`` may be nonzero
        (their angular davg is 0 from the statistics, not necessarily in a loaded file)."""
        flat = nlist.reshape(-1, self.nnei)
        padded_nonzero = self.davg[:, :, 1:] != 0
        out: list[int] = []
        for t in range(self.ntypes):
            lo, n = self.offsets[t], self.sel[t]
            if n == 0 or flat.shape[0] == 0 or bool(padded_nonzero[:, lo : lo + n].any()):
                out.append(n)
            else:
                place = torch.arange(1, n + 1, device=flat.device)
                out.append(int(((flat[:, lo : lo + n] >= 0).to(place.dtype) * place).max()))
        return out

    def for_export(self) -> "DescriptorSeT":
        """This descriptor summing every slot (`mdtrain.model.export_form`)."""
        return recast(self, DescriptorSeTAllSlots)

    def forward(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """Descriptor D (nf, N, neuron[-1]) in the descriptor dtype.

        Two savings on the plain sum (``DescriptorSeTPadded``), equal to it to rounding: a
        slot after the last real one of every centre has the row 0 (padding, angular davg
        0), so its products ``g`` and terms ``g·G(g)`` are exactly 0 and only the first
        ``block_windows`` slots of each type enter; and in a block of one type (ti = tj)
        ``g_jk = g_kj``, so the net runs on ``j <= k`` only, the terms ``j < k`` counted twice.
        The net evaluations drop from ``sel[ti]·sel[tj]`` to about ``real²/2`` per block."""
        nf, natoms = diff.shape[0], diff.shape[1]
        rows = self.normalized_rows(diff, nlist, atype).view(nf * natoms, self.nnei, 4)
        angular = rows[:, :, 1:]
        window = self.block_windows(nlist)
        out = torch.zeros(nf * natoms, self.neuron_out, dtype=rows.dtype, device=rows.device)
        for k, net in enumerate(self.networks):
            ti, tj = self.first[k], self.second[k]
            wi, wj = window[ti], window[tj]
            if wi > 0 and wj > 0:  # a block without real slots adds exactly 0
                a_i = angular[:, self.offsets[ti] : self.offsets[ti] + wi]
                a_j = angular[:, self.offsets[tj] : self.offsets[tj] + wj]
                g = torch.bmm(a_i, a_j.transpose(1, 2)).reshape(a_i.shape[0], wi * wj)
                if ti == tj:
                    upper = torch.triu_indices(wi, wi, device=g.device)
                    g = g.index_select(1, upper[0] * wi + upper[1])
                    twice = torch.where(upper[0] == upper[1], 1.0, 2.0).to(g.dtype)
                    weighted = g * twice
                else:
                    weighted = g
                x = g.reshape(-1, 1)
                for layer in net.layers:
                    x = residual_by_cat(
                        layer.product(x), x, layer.activation, layer.idt, layer.skip
                    )
                emb = x.view(g.shape[0], -1, self.neuron_out)
                res = torch.bmm(weighted.unsqueeze(1), emb).squeeze(1)
                out = out + res * (1.0 / float(self.sel[ti] * self.sel[tj]))
        return out.view(nf, natoms, self.neuron_out)


class DescriptorSeTAllSlots(DescriptorSeT):
    """se_e3 whose sums see every slot of each type block (the symmetric half kept): the
    windows are read from the list's values, which a ``torch.export`` program cannot do.
    Equal to `DescriptorSeT` to rounding (the slots past the windows add exactly 0)."""

    def block_windows(self, nlist: Tensor) -> list[int]:
        return [int(n) for n in self.sel]


class DescriptorSeTPadded(DescriptorSeT):
    """The plain se_e3 sum over every pair of slots, padding included: the reference the
    windowed, symmetric ``DescriptorSeT.forward`` is tested against."""

    def forward(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """Descriptor D (nf, N, neuron[-1]) in the descriptor dtype."""
        nf, natoms = diff.shape[0], diff.shape[1]
        rows = self.normalized_rows(diff, nlist, atype).view(nf * natoms, self.nnei, 4)
        angular = rows[:, :, 1:]
        out = torch.zeros(nf * natoms, self.neuron_out, dtype=rows.dtype, device=rows.device)
        for k, net in enumerate(self.networks):
            ti, tj = self.first[k], self.second[k]
            a_i = angular[:, self.offsets[ti] : self.offsets[ti + 1]]
            a_j = angular[:, self.offsets[tj] : self.offsets[tj + 1]]
            g = torch.bmm(a_i, a_j.transpose(1, 2))  # (B, sel[ti], sel[tj])
            emb = net(g.reshape(-1, 1)).view(g.shape[0], g.shape[1] * g.shape[2], self.neuron_out)
            res = torch.bmm(g.reshape(g.shape[0], 1, -1), emb).squeeze(1)
            out = out + res * (1.0 / float(max(self.sel[ti] * self.sel[tj], 1)))  # 0 slots: res 0
        return out.view(nf, natoms, self.neuron_out)

    def for_export(self) -> "DescriptorSeTPadded":
        return self  # no window to leave out
