"""The se_e2_a descriptor (DeePMD-compatible): smooth environment matrix -> embedding -> D.

For centre i and neighbour slot j, the raw row is ``w(r)·[1/r, x/r², y/r², z/r²]`` with the C²
switch ``w``; padded slots (nlist == -1) give a raw row of exactly 0. Rows are normalised by
the centre type's ``davg``/``dstd``, so a padded slot becomes ``-davg/dstd`` and still feeds
the embedding net, as in DeePMD. Excluded type pairs are zeroed after normalisation (padded
slots are never excluded). ``T = Σ_t R̃_tᵀ G_t(s_t) / sum(sel)``, ``D = Tᵀ T[:, :axis]``.
"""

from typing import Any

import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.base import Descriptor, smooth_weight
from mdtrain.model.descriptors.se_deepmd import se_from_deepmd, se_to_deepmd
from mdtrain.model.network import EmbeddingNet, check_activation, child_seed, dtype_of

__all__ = ["AngularRowsDescriptor", "DescriptorSeA", "smooth_weight"]

SE_E2_A_DEFAULTS: dict[str, Any] = {
    "type": "se_e2_a",
    "rcut": 6.0,
    "rcut_smth": 0.5,
    "neuron": [10, 20, 40],
    "axis_neuron": 4,
    "activation_function": "tanh",
    "resnet_dt": False,
    "type_one_side": False,
    "precision": "default",
    "trainable": True,
    "seed": None,
    "exclude_types": [],
    "env_protection": 0.0,
    "set_davg_zero": False,
}


def check_embedding_config(desc: dict, where: str) -> None:
    """The checks every per-type-block embedding descriptor (se_e2_a, se_e2_r) shares."""
    if not float(desc["rcut_smth"]) < float(desc["rcut"]):
        raise MDTrainError(
            f"{where}/rcut_smth: {desc['rcut_smth']} must be smaller than rcut {desc['rcut']}"
        )
    if not desc["neuron"]:
        raise MDTrainError(f"{where}/neuron: at least one layer is required")


def type_nets(
    ntypes: int,
    neuron: list[int],
    type_one_side: bool,
    activation: str,
    resnet_dt: bool,
    dtype: torch.dtype,
    seed: int | None,
    trainable: bool,
) -> nn.ModuleList:
    """The embedding nets of the se_e2 family: one per neighbour type, or one per (centre,
    neighbour) pair with flat index centre + neighbour·ntypes."""
    nnets = ntypes if type_one_side else ntypes * ntypes
    nets = nn.ModuleList(
        [
            EmbeddingNet(list(neuron), activation, resnet_dt, dtype, child_seed(seed, k))
            for k in range(nnets)
        ]
    )
    for p in nets.parameters():
        p.requires_grad_(trainable)
    return nets


def embedding_kwargs(desc: dict, where: str = "model/descriptor") -> dict[str, Any]:
    """Constructor arguments every embedding descriptor takes, from a filled config."""
    return {
        "rcut": float(desc["rcut"]),
        "rcut_smth": float(desc["rcut_smth"]),
        "neuron": [int(n) for n in desc["neuron"]],
        "type_one_side": bool(desc["type_one_side"]),
        "resnet_dt": bool(desc["resnet_dt"]),
        "activation": check_activation(desc["activation_function"], f"{where}/activation_function"),
        "dtype": dtype_of(desc["precision"], f"{where}/precision"),
        "seed": desc["seed"],
        "exclude_types": desc["exclude_types"],
        "set_davg_zero": bool(desc["set_davg_zero"]),
        "env_protection": float(desc["env_protection"]),
        "trainable": bool(desc["trainable"]),
    }


class AngularRowsDescriptor(Descriptor):
    """What the descriptors built on the 4-column rows ``w(r)/r·[1, d/r]`` share (se_e2_a,
    se_e3): the rows, their normalisation and their statistics (groups r and a)."""

    stat_groups = ("r", "a")
    stat_columns = ((0, 1), (1, 4))
    stat_mirror = (1.0, -1.0)
    ncols = 4

    def pair_stat_terms(self, d: Tensor) -> list[Tensor]:
        """[s, s², a_x + a_y + a_z, |a|²] of the raw row ``[s, a] = w(r)/(r+p)·[1, d/(r+p)]``
        (``env_matrix``'s formula, ``p`` its ``env_protection``)."""
        ones = torch.ones(3, dtype=d.dtype, device=d.device)
        r2 = (d * d) @ ones
        r = torch.sqrt(r2)
        rp = r + self.env_protection
        s = smooth_weight(r, self.rcut_smth, self.rcut) / rp
        q = s / rp  # a = d · q
        return [s, s * s, (d @ ones) * q, r2 * (q * q)]

    def env_matrix(self, diff: Tensor, mask: Tensor) -> Tensor:
        """Raw rows (nf, N, nnei, 4) from neighbour-minus-centre vectors; 0 where ~mask."""
        far = torch.full_like(diff, 2.0 * self.rcut)
        diff = torch.where(mask.unsqueeze(-1), diff, far)  # keeps r > 0 so gradients stay finite
        r = torch.linalg.vector_norm(diff, dim=-1, keepdim=True)
        rp = r + self.env_protection
        w = smooth_weight(r, self.rcut_smth, self.rcut) * mask.unsqueeze(-1).to(diff.dtype)
        inv = w / rp
        return torch.cat([inv, diff * (inv / rp)], dim=-1)

    def normalized_rows(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """Rows R̃ (nf, N, nnei, 4) in the descriptor dtype: ``(raw − davg)/dstd`` of the
        centre's type, 0 for excluded pairs."""
        raw = self.env_matrix(diff.to(self.dtype), nlist >= 0)
        davg_all, dstd_all = self.davg.to(self.dtype), self.dstd.to(self.dtype)
        rr = (raw - davg_all[atype]) / dstd_all[atype]
        if self.has_exclusions:
            rr = rr * self.keep_mask(nlist, atype).unsqueeze(-1).to(rr.dtype)
        return rr


class DescriptorSeA(AngularRowsDescriptor):
    """se_e2_a descriptor. Buffers ``davg``/``dstd`` (ntypes, sum(sel), 4) are float64."""

    type_name = "se_e2_a"
    aliases = ("se_a",)
    defaults = SE_E2_A_DEFAULTS
    deepmd_types = ("se_e2_a", "se_a")

    offsets: list[int]
    axis_neuron: int
    neuron_out: int
    type_one_side: bool

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
        self.init_common(ntypes, sel, rcut, rcut_smth, exclude_types, set_davg_zero, env_protection)
        self.axis_neuron = int(axis_neuron)
        self.neuron_out = int(neuron[-1])
        self.type_one_side = bool(type_one_side)
        self.dtype = dtype
        self.networks = type_nets(
            ntypes, neuron, type_one_side, activation, resnet_dt, dtype, seed, trainable
        )

    @classmethod
    def check_config(cls, desc: dict, ntypes: int, where: str) -> None:
        check_embedding_config(desc, where)
        if not 0 < int(desc["axis_neuron"]) <= int(desc["neuron"][-1]):
            raise MDTrainError(
                f"{where}/axis_neuron: {desc['axis_neuron']} must be in 1..neuron[-1]"
            )

    @classmethod
    def from_config(cls, desc: dict, ntypes: int) -> "DescriptorSeA":
        return cls(
            ntypes=ntypes,
            sel=[int(s) for s in desc["sel"]],
            axis_neuron=int(desc["axis_neuron"]),
            **embedding_kwargs(desc),
        )

    @property
    def dim_out(self) -> int:
        return self.neuron_out * self.axis_neuron

    def to_deepmd(self, cfg: dict, type_map: list[str]) -> dict:
        out = se_to_deepmd(self, cfg, type_map, "se_e2_a")
        out["axis_neuron"] = int(self.axis_neuron)
        return out

    @classmethod
    def from_deepmd(cls, r: Any, d: dict, state: dict) -> dict:
        axis = int(r.get(d, "axis_neuron", "model/descriptor"))
        return {"type": "se_e2_a", "axis_neuron": axis, **se_from_deepmd(r, d, state, 4)}

    def embedding_nets(self) -> list[nn.Module]:
        return list(self.networks)

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

    @property
    def dim_emb(self) -> int:
        """Rows of the rotation matrix (DeePMD-kit's ``get_dim_emb``): a tensor fitting's
        ``embedding_width``."""
        return self.neuron_out

    def forward_with_rot(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> tuple[Tensor, Tensor]:
        """``(D, gr)``: the descriptor as `forward` gives it, and the rotation matrix ``gr``
        (nf, N, M, 3) that tensor fittings contract with: DeePMD-kit's ``gr[..., 1:]``, i.e.
        the last three rows of ``T/nnei`` transposed (it turns with the frame: ``gr R``)."""
        nf, natoms = diff.shape[0], diff.shape[1]
        rr = self.normalized_rows(diff, nlist, atype)
        if self.type_one_side:
            t = self._contract(rr.view(nf * natoms, self.nnei, 4), -1) / self.nnei
        else:
            t = torch.zeros(nf, natoms, 4, self.neuron_out, dtype=rr.dtype, device=rr.device)
            for c in range(self.ntypes):
                idx = torch.nonzero(atype == c).view(-1)
                tc = self._contract(rr.index_select(1, idx).reshape(-1, self.nnei, 4), c)
                t = t.index_copy(1, idx, (tc / self.nnei).view(nf, -1, 4, self.neuron_out))
            t = t.view(nf * natoms, 4, self.neuron_out)
        d = self.descriptor_of_t(t).view(nf, natoms, self.dim_out)
        gr = t[:, 1:, :].transpose(1, 2).reshape(nf, natoms, self.neuron_out, 3)
        return d, gr

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
                g = net(block[:, :, 0].reshape(-1, 1)).view(
                    rows.shape[0], block.shape[1], self.neuron_out
                )
                tmat = tmat + torch.bmm(block.transpose(1, 2), g)
        return tmat

    def descriptor_of_t(self, t: Tensor) -> Tensor:
        """T/nnei (B, 4, M) -> D (B, M·axis), flattened row-major (index m·axis + a)."""
        d = torch.matmul(t.transpose(1, 2), t[:, :, : self.axis_neuron])
        return d.reshape(t.shape[0], self.dim_out)
