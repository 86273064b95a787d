"""The se_atten (DPA-1) and se_atten_v2 descriptors, with DeePMD-kit 3.2's semantics.

The neighbour list is type-mixed (``mixed_types``): ``sel`` slots over all types, nearest
first, -1 padding. Per slot, the se_e2_a row ``R̃ = (w(r)/(r+p)·[1, d/(r+p)] − davg)/dstd``
of the centre's type (a padded slot is ``−davg/dstd``, an excluded pair 0), and an
embedding ``G`` of its radial column and the type embeddings: "concat" feeds
``[s, T_j(, T_i)]`` to one net, "strip" multiplies the radial net's output by a net of the
types alone (``G = G_s·(1 + G_t)``, ``G_t`` switched off smoothly with
``smooth_type_embedding``). ``attn_layer`` gated self-attention layers mix the slots
(attention.py), then ``T = GᵀR̃/sel`` and ``D = T T_<ᵀ`` (``axis_neuron`` columns), followed
by the centre's type embedding when ``concat_output_tebd``. An empty slot takes the type of
atom 0, as DeePMD-kit's does. se_atten_v2 is se_atten with "strip" and the smooth type
embedding fixed. Weights in and out of DeePMD-kit's form: se_atten_io.py.
"""

import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.attention import AttentionStack, GatedAttentionLayer
from mdtrain.model.descriptors.layers import DenseNet, activation_name
from mdtrain.model.descriptors.mixed_base import MixedTypesDescriptor
from mdtrain.model.descriptors.moments import degree_weights, moment_basis
from mdtrain.model.descriptors.type_embedding import TypeEmbedNet
from mdtrain.model.gather import take, take_pairs
from mdtrain.model.network import child_seed

# DeePMD-kit 3.2's argcheck defaults (descrpt_se_atten_args); sel has none, seed is unset.
DEFAULTS: dict = {
    "seed": None,
    "rcut": 6.0,
    "rcut_smth": 0.5,
    "neuron": [10, 20, 40],
    "axis_neuron": 4,
    "lmax": None,
    "activation_function": "tanh",
    "resnet_dt": False,
    "type_one_side": False,
    "precision": "default",
    "trainable": True,
    "exclude_types": [],
    "env_protection": 0.0,
    "attn": 128,
    "attn_layer": 2,
    "attn_dotr": True,
    "attn_mask": False,
    "stripped_type_embedding": None,
    "smooth_type_embedding": False,
    "set_davg_zero": True,
    "trainable_ln": True,
    "ln_eps": None,
    "tebd_dim": 8,
    "use_econf_tebd": False,
    "use_tebd_bias": False,
    "tebd_input_mode": "concat",
    "scaling_factor": 1.0,
    "normalize": True,
    "temperature": None,
    "concat_output_tebd": True,
}
# se_atten_v2 (descrpt_se_atten_v2_args): no tebd_input_mode, smooth_type_embedding or
# stripped_type_embedding key (fixed to strip and smooth), and davg is not set to zero.
V2_FIXED = {"tebd_input_mode": "strip", "smooth_type_embedding": True}
V2_DEFAULTS = {
    **{k: v for k, v in DEFAULTS.items() if k not in (*V2_FIXED, "stripped_type_embedding")},
    "set_davg_zero": False,
}


def unit_rows(x: Tensor) -> Tensor:
    """``x/max(|x|, 1e-12)`` over the last axis, with a zero gradient at x = 0."""
    sq = (x * x).sum(dim=-1, keepdim=True)
    norm = torch.where(sq > 0, torch.sqrt(torch.where(sq > 0, sq, torch.ones_like(sq))), 0.0 * sq)
    return x / torch.clamp(norm, min=1e-12)


class DescriptorSeAtten(MixedTypesDescriptor):
    """se_atten / se_atten_v2. Buffers ``davg``/``dstd`` (ntypes, sel, 4) float64."""

    type_name = "se_atten"
    aliases = ("dpa1",)
    defaults = {"type": "se_atten", **DEFAULTS}
    deepmd_types = ("dpa1", "se_atten")
    # TorchScript: branches on these are resolved when the model is scripted
    __constants__ = [
        "strip", "smooth", "type_one_side", "concat_output_tebd", "lmax", "attn_dotr"
    ]  # fmt: skip

    def __init__(
        self,
        ntypes: int,
        sel: int | list[int],
        rcut: float = 6.0,
        rcut_smth: float = 0.5,
        neuron: list[int] = (10, 20, 40),
        axis_neuron: int = 4,
        tebd_dim: int = 8,
        tebd_input_mode: str = "concat",
        attn: int = 128,
        attn_layer: int = 2,
        attn_dotr: bool = True,
        attn_mask: bool = False,
        smooth_type_embedding: bool = False,
        scaling_factor: float = 1.0,
        normalize: bool = True,
        temperature: float | None = None,
        trainable_ln: bool = True,
        ln_eps: float | None = None,
        concat_output_tebd: bool = True,
        set_davg_zero: bool = True,
        type_one_side: bool = False,
        exclude_types: list[list[int]] | None = None,
        env_protection: float = 0.0,
        resnet_dt: bool = False,
        activation_function: str = "tanh",
        precision: str = "default",
        trainable: bool = True,
        use_econf_tebd: bool = False,
        use_tebd_bias: bool = False,
        lmax: int | None = None,
        stripped_type_embedding: bool | None = None,
        type_map: list[str] | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        where = f"model/descriptor ({self.type_name})"
        if stripped_type_embedding is not None:  # deprecated spelling of tebd_input_mode
            tebd_input_mode = "strip" if stripped_type_embedding else "concat"
        if tebd_input_mode not in ("concat", "strip"):
            raise MDTrainError(
                f"{where}/tebd_input_mode: {tebd_input_mode!r} is not concat or strip"
            )
        if attn_mask:
            raise MDTrainError(f"{where}/attn_mask: true is not supported (nor by DeePMD-kit)")
        lmax = 1 if lmax is None else int(lmax)
        if lmax not in (1, 2, 3, 4):
            raise MDTrainError(f"{where}/lmax: {lmax} is not between 1 and 4")
        if int(axis_neuron) > int(neuron[-1]):
            raise MDTrainError(f"{where}/axis_neuron: {axis_neuron} exceeds neuron[-1]")
        self.init_mixed(
            ntypes, sel, rcut, rcut_smth, env_protection, set_davg_zero, exclude_types,
            precision, where,
        )  # fmt: skip
        self.settings = {
            "neuron": [int(n) for n in neuron], "axis_neuron": int(axis_neuron),
            "tebd_dim": int(tebd_dim), "tebd_input_mode": tebd_input_mode, "attn": int(attn),
            "attn_layer": int(attn_layer), "attn_dotr": bool(attn_dotr),
            "smooth_type_embedding": bool(smooth_type_embedding),
            "scaling_factor": float(scaling_factor), "normalize": bool(normalize),
            "temperature": None if temperature is None else float(temperature),
            "trainable_ln": bool(trainable_ln), "ln_eps": 1e-5 if ln_eps is None else float(ln_eps),
            "concat_output_tebd": bool(concat_output_tebd), "type_one_side": bool(type_one_side),
            "resnet_dt": bool(resnet_dt), "use_tebd_bias": bool(use_tebd_bias), "lmax": lmax,
            "activation_function": activation_name(activation_function, where),
            "trainable": bool(trainable), "type_map": type_map, "precision": precision,
        }  # fmt: skip
        s = self.settings
        self.axis_neuron, self.ng, self.tebd_dim = s["axis_neuron"], s["neuron"][-1], s["tebd_dim"]
        self.strip, self.smooth = tebd_input_mode == "strip", s["smooth_type_embedding"]
        self.type_one_side, self.lmax = s["type_one_side"], lmax
        self.attn_dotr = s["attn_dotr"]
        self.concat_output_tebd = s["concat_output_tebd"]
        self.type_embedding = TypeEmbedNet(
            ntypes, [tebd_dim], "linear", precision=precision, trainable=trainable,
            seed=child_seed(seed, 1), padding=True, use_econf_tebd=use_econf_tebd,
            use_tebd_bias=use_tebd_bias, type_map=type_map,
        )  # fmt: skip
        tebd_in = tebd_dim if type_one_side else 2 * tebd_dim
        act = s["activation_function"]
        net_in = 1 if self.strip else 1 + tebd_in
        args = (act, resnet_dt, True, self.dtype)
        self.embedding = DenseNet(net_in, s["neuron"], *args, child_seed(seed, 0), trainable)
        self.embedding_strip = (
            DenseNet(tebd_in, s["neuron"], *args, child_seed(seed, 2), trainable)
            if self.strip
            else None
        )
        layers = [
            GatedAttentionLayer(
                self.ng,
                attn,
                attn_dotr,
                scaling_factor,
                normalize,
                temperature,
                trainable_ln,
                s["ln_eps"],
                self.smooth,
                self.dtype,
                child_seed(seed, 3, k),
                trainable,
            )  # fmt: skip
            for k in range(int(attn_layer))
        ]
        self.attention = AttentionStack(layers, self.smooth, self.attn_dotr)
        gain = torch.normal(0.0, 0.1, (max(lmax - 1, 0),), generator=_gen(seed, 4))
        self.degree_gain = nn.Parameter(gain.to(self.dtype), trainable) if lmax > 1 else None

    @classmethod
    def from_config(cls, desc: dict, ntypes: int, type_map: list[str] | None = None):
        """From a filled ``model.descriptor`` section (``sel`` resolved to numbers)."""
        kind = desc.get("type", cls.type_name)
        known = V2_DEFAULTS if kind == "se_atten_v2" else DEFAULTS
        unknown = sorted(set(desc) - set(known) - {"type", "sel", "seed"})
        if unknown:
            raise MDTrainError(f"model/descriptor ({kind}): unknown key {unknown[0]!r}")
        settings = {**known, **{k: v for k, v in desc.items() if k != "type"}}
        if kind == "se_atten_v2":
            return DescriptorSeAttenV2(ntypes, type_map=type_map, **settings)
        return cls(ntypes, type_map=type_map, **settings)

    def to_config(self) -> dict:
        """The filled ``model.descriptor`` section that builds this descriptor (argcheck's
        keys; ``lmax`` 1 written as unset), ``seed`` left out."""
        values = {
            **self.settings,
            "rcut": self.rcut, "rcut_smth": self.rcut_smth, "set_davg_zero": self.set_davg_zero,
            "exclude_types": [list(p) for p in self.exclude_types],
            "env_protection": self.env_protection, "attn_mask": False,
            "stripped_type_embedding": None, "use_econf_tebd": False,
            "lmax": None if self.lmax == 1 else self.lmax,
            "ln_eps": None if self.settings["ln_eps"] == 1e-5 else self.settings["ln_eps"],
        }  # fmt: skip
        kept = (k for k in self.defaults if k not in ("type", "seed"))
        return {"type": self.type_name, "sel": self.nnei, **{k: values[k] for k in kept}}

    @property
    def dim_emb(self) -> int:
        """Rows of the rotation matrix (DeePMD-kit's ``get_dim_emb``): a tensor fitting's
        ``embedding_width``."""
        return self.ng

    @property
    def dim_out(self) -> int:
        return self.ng * self.axis_neuron + (self.tebd_dim if self.concat_output_tebd else 0)

    def deepmd_dict(self) -> dict:
        """DeePMD-kit's serialised descriptor dict (se_atten_io.py)."""
        from mdtrain.model.descriptors.se_atten_io import to_deepmd

        return to_deepmd(self)

    @classmethod
    def from_deepmd_dict(cls, data: dict, where: str = "descriptor") -> "DescriptorSeAtten":
        """From DeePMD-kit's serialised dict, "dpa1"/"se_atten" or "se_atten_v2" (se_atten_io.py)."""
        from mdtrain.model.descriptors.se_atten_io import from_deepmd

        return from_deepmd(data, where)

    def forward(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """D (nf, N, dim_out) from ``diff`` (nf, N, sel, 3), ``nlist`` (nf, N, sel) with -1
        padding (any order of the slots gives the same D) and ``atype`` (N,)."""
        return self.forward_with_rot(diff, nlist, atype)[0]

    def forward_with_rot(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> tuple[Tensor, Tensor]:
        """``(D, gr)``: D as `forward` gives it, and the rotation matrix ``gr`` (nf, N, ng, 3)
        the dipole and polar fittings contract with: DeePMD-kit's ``rot_mat``, the columns
        1..3 of ``T = GᵀR̃/sel`` (the l = 1 moments; it turns with the frame: ``gr R``)."""
        nf, natoms, nnei = nlist.shape
        diff = diff.to(self.dtype)
        rr, sw, valid = self.normalized_rows(diff, nlist, atype)
        tebd = self.type_embedding()  # (ntypes + 1, tebd_dim)
        nei_type = atype[torch.where(valid, nlist, 0)]  # empty slots: atom 0's type
        centre = atype.view(1, natoms, 1).expand(nf, natoms, nnei)
        g = self._embed(rr[..., :1], tebd, nei_type, centre, sw)
        g = g.reshape(nf * natoms, nnei, self.ng)
        mask2, sw2 = valid.reshape(-1, nnei), sw.reshape(-1, nnei)
        if len(self.attention):
            r_hat = unit_rows(rr[..., 1:4]).reshape(-1, nnei, 3)
            g = self.attention(g, mask2, sw2, r_hat)
        basis = rr.reshape(-1, nnei, 4)
        if self.lmax > 1:
            basis = moment_basis(
                basis, (diff * (nlist >= 0).unsqueeze(-1).to(diff.dtype)).reshape(-1, nnei, 3),
                sw.reshape(-1, nnei, 1), self._radial_std(atype, nf),
                mask2, self.lmax, self.env_protection,
            )  # fmt: skip
        t = torch.matmul(g.transpose(1, 2), basis) / nnei  # (B, ng, moments)
        t_axis = t[:, : self.axis_neuron]
        if self.degree_gain is not None:
            t_axis = t_axis * degree_weights(self.degree_gain, self.lmax)
        d = torch.matmul(t, t_axis.transpose(1, 2)).reshape(nf, natoms, self.ng * self.axis_neuron)
        if self.concat_output_tebd:
            d = torch.cat([d, take(tebd, atype).unsqueeze(0).expand(nf, -1, -1)], dim=-1)
        return d, t[:, :, 1:4].reshape(nf, natoms, self.ng, 3)

    def _radial_std(self, atype: Tensor, nf: int) -> Tensor:
        """(nf·N, sel, 1): the radial dstd of each slot's centre type."""
        std = self.dstd.to(self.dtype)[atype][..., :1]
        return std.expand(nf, -1, -1, -1).reshape(-1, self.nnei, 1)

    def _embed(self, s: Tensor, tebd: Tensor, nei_type: Tensor, centre: Tensor, sw: Tensor):
        """G (nf, N, nnei, ng) of the radial column ``s`` and the type embeddings."""
        if not self.strip:
            parts = [s, take(tebd, nei_type)]
            if not self.type_one_side:
                parts.append(take(tebd, centre))
            return self.embedding(torch.cat(parts, dim=-1))
        if self.type_one_side:
            g_t = take(self.embedding_strip(tebd), nei_type)
        else:
            n, width = tebd.shape  # pairs (centre i, neighbour j) -> [T_j, T_i]
            pairs = torch.cat(
                [tebd.unsqueeze(0).expand(n, n, width), tebd.unsqueeze(1).expand(n, n, width)], -1
            )
            g_t = take_pairs(self.embedding_strip(pairs), centre, nei_type)
        if self.smooth:
            g_t = g_t * sw
        g_s = self.embedding(s)
        return g_s * g_t + g_s


class DescriptorSeAttenV2(DescriptorSeAtten):
    """se_atten_v2: se_atten with the "strip" type embedding and smooth attention fixed."""

    type_name = "se_atten_v2"
    aliases = ()
    defaults = {"type": "se_atten_v2", **V2_DEFAULTS}
    deepmd_types = ("se_atten_v2",)

    def __init__(self, ntypes: int, sel: int | list[int], **settings) -> None:
        fixed = sorted(set(settings) & {*V2_FIXED, "stripped_type_embedding"})
        if fixed:
            raise MDTrainError(
                f"model/descriptor (se_atten_v2): {fixed[0]!r} is fixed by se_atten_v2"
            )
        super().__init__(ntypes, sel, **{**V2_DEFAULTS, **settings, **V2_FIXED})


def _gen(seed: int | None, *path: int) -> torch.Generator | None:
    child = child_seed(seed, *path)
    return None if child is None else torch.Generator().manual_seed(child)
