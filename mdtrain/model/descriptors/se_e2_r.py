"""The se_e2_r descriptor (DeePMD-kit's radial-only smooth edition).

For centre i and neighbour slot j the raw entry is ``s = w(r)/(r + p)`` (``w`` the C²
switch, ``p`` ``env_protection``), 0 in padded slots; it is normalised by the centre
type's ``davg``/``dstd`` (a padded slot becomes ``-davg/dstd`` and still feeds the net, as
in DeePMD-kit) and zeroed for excluded type pairs. Each slot's ``s̃`` goes through the
embedding net of its neighbour type (or of its centre and neighbour type pair without
``type_one_side``) and ``D = Σ_j G(s̃_j) / sum(sel) / 5`` (DeePMD-kit's rescaling), of width
``neuron[-1]``. It costs one embedding evaluation per slot, like se_e2_a, but no angular
product.

DeePMD-kit's numpy and PyTorch implementations build one net per neighbour type whatever
``type_one_side`` says; its TensorFlow one builds one per pair without it, as here.
"""

from typing import Any

import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.base import Descriptor, smooth_weight
from mdtrain.model.descriptors.se_deepmd import se_from_deepmd, se_to_deepmd
from mdtrain.model.descriptors.se_e2_a import check_embedding_config, embedding_kwargs, type_nets

SE_E2_R_DEFAULTS: dict[str, Any] = {
    "type": "se_e2_r",
    "rcut": 6.0,
    "rcut_smth": 0.5,
    "neuron": [10, 20, 40],
    "activation_function": "tanh",
    "resnet_dt": False,
    "type_one_side": False,
    "precision": "default",
    "trainable": True,
    "seed": None,
    "exclude_types": [],
    "set_davg_zero": False,
    "env_protection": 0.0,
}


class DescriptorSeR(Descriptor):
    """se_e2_r descriptor. Buffers ``davg``/``dstd`` (ntypes, sum(sel), 1) are float64."""

    type_name = "se_e2_r"
    aliases = ("se_r",)
    defaults = SE_E2_R_DEFAULTS
    stat_groups = ("r",)
    stat_columns = ((0, 1),)
    stat_mirror = (1.0,)
    ncols = 1
    deepmd_types = ("se_e2_r", "se_r")

    neuron_out: int
    type_one_side: bool

    def __init__(
        self,
        ntypes: int,
        sel: list[int],
        rcut: float,
        rcut_smth: float,
        neuron: list[int],
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
        self.init_common(ntypes, sel, rcut, rcut_smth, exclude_types, set_davg_zero, env_protection)
        self.neuron_out = int(neuron[-1])
        self.type_one_side = bool(type_one_side)
        self.dtype = dtype
        self.networks = type_nets(
            ntypes, neuron, type_one_side, activation, resnet_dt, dtype, seed, trainable
        )

    @classmethod
    def check_config(cls, desc: dict, ntypes: int, where: str) -> None:
        check_embedding_config(desc, where)

    @classmethod
    def from_config(cls, desc: dict, ntypes: int) -> "DescriptorSeR":
        return cls(ntypes=ntypes, sel=[int(s) for s in desc["sel"]], **embedding_kwargs(desc))

    @property
    def dim_out(self) -> int:
        return self.neuron_out

    def to_deepmd(self, cfg: dict, type_map: list[str]) -> dict:
        if not self.type_one_side:
            raise MDTrainError(
                "model/descriptor/type_one_side: false has no DeePMD-kit .dp form for "
                "se_e2_r (its numpy and PyTorch se_e2_r build one net per neighbour type)"
            )
        return se_to_deepmd(self, cfg, type_map, "se_r")

    @classmethod
    def from_deepmd(cls, r: Any, d: dict, state: dict) -> dict:
        return {"type": "se_e2_r", **se_from_deepmd(r, d, state, 1)}

    def embedding_nets(self) -> list[nn.Module]:
        return list(self.networks)

    def env_matrix(self, diff: Tensor, mask: Tensor) -> Tensor:
        """Raw entries (nf, N, nnei, 1) ``w(r)/(r + p)``; 0 where ~mask."""
        far = torch.full_like(diff, 2.0 * self.rcut)
        diff = torch.where(mask.unsqueeze(-1), diff, far)  # keeps r > 0: finite gradients
        r = torch.linalg.vector_norm(diff, dim=-1, keepdim=True)
        w = smooth_weight(r, self.rcut_smth, self.rcut) * mask.unsqueeze(-1).to(diff.dtype)
        return w / (r + self.env_protection)

    def pair_stat_terms(self, d: Tensor) -> list[Tensor]:
        """[s, s²] of the raw entry ``s = w(r)/(r + p)``."""
        r = torch.linalg.vector_norm(d, dim=-1)
        s = smooth_weight(r, self.rcut_smth, self.rcut) / (r + self.env_protection)
        return [s, s * s]

    def forward(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """Descriptor D (nf, N, neuron[-1]) in the descriptor dtype."""
        nf, natoms = diff.shape[0], diff.shape[1]
        raw = self.env_matrix(diff.to(self.dtype), nlist >= 0)
        davg, dstd = self.davg.to(self.dtype), self.dstd.to(self.dtype)
        rr = (raw - davg[atype]) / dstd[atype]
        if self.has_exclusions:
            rr = rr * self.keep_mask(nlist, atype).unsqueeze(-1).to(rr.dtype)
        if self.type_one_side:
            d = self._embed(rr.view(nf * natoms, self.nnei, 1), -1)
            return d.view(nf, natoms, self.neuron_out)
        out = torch.zeros(nf, natoms, self.neuron_out, dtype=rr.dtype, device=rr.device)
        for c in range(self.ntypes):
            idx = torch.nonzero(atype == c).view(-1)
            d = self._embed(rr.index_select(1, idx).reshape(-1, self.nnei, 1), c)
            out = out.index_copy(1, idx, d.view(nf, -1, self.neuron_out))
        return out

    def _embed(self, rows: Tensor, centre: int) -> Tensor:
        """(B, M): ``Σ_j G(s̃_j) / nnei / 5`` over the slots of rows (B, nnei, 1); ``centre``
        -1: nets by neighbour type, otherwise that centre type's nets."""
        acc = torch.zeros(rows.shape[0], self.neuron_out, dtype=rows.dtype, device=rows.device)
        for k, net in enumerate(self.networks):
            if centre < 0 or k % self.ntypes == centre:
                t = k if centre < 0 else k // self.ntypes
                block = rows[:, self.offsets[t] : self.offsets[t + 1]]  # (B, n, 1)
                g = net(block.reshape(-1, 1))
                g = g.view(
                    rows.shape[0], block.shape[1], self.neuron_out
                )  # (no rows: a type absent)
                acc = acc + g.sum(dim=1)
        return acc * (0.2 / self.nnei)  # DeePMD-kit's res_rescale 1/5
