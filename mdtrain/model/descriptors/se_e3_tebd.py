"""The se_e3_tebd descriptor (three-body embedding with type embedding), DeePMD-kit 3.2.

Type-mixed list of ``sel`` slots (as se_atten's). With the normalised rows ``R̃`` (excluded
pairs 0, padded slots ``−davg/dstd``), every pair of slots (j, k) of a centre gives the
angle term ``e_jk = R̃_j[1:]·R̃_k[1:]``; an embedding of it and of the two neighbours' type
embeddings ("concat": one net of ``[e_jk, T_j, T_k]``; "strip": ``G = G_e(1 + G_t)`` with
``G_t`` a net of ``[T_j, T_k]``, switched off smoothly by ``w_j·w_k`` with ``smooth``)
is contracted back with it: ``D = Σ_jk e_jk G_jk / sel²``, then the centre's type embedding
when ``concat_output_tebd``. Empty slots take atom 0's type, as in DeePMD-kit. Cost and
memory grow as sel² per atom.
"""

import torch
from torch import Tensor

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.layers import DTYPE_NAMES, DenseNet, activation_name
from mdtrain.model.descriptors.mixed_base import (
    MixedTypesDescriptor,
    configured_precision,
    net_collection,
    one_net,
    refuse_unsupported,
)
from mdtrain.model.descriptors.type_embedding import TypeEmbedNet
from mdtrain.model.export_form import recast
from mdtrain.model.gather import take, take_pairs
from mdtrain.model.network import child_seed, residual_by_cat

# DeePMD-kit 3.2's argcheck defaults (descrpt_se_e3_tebd_args); sel has none, seed is unset.
DEFAULTS: dict = {
    "seed": None,
    "rcut": 6.0,
    "rcut_smth": 0.5,
    "neuron": [10, 20, 40],
    "tebd_dim": 8,
    "tebd_input_mode": "concat",
    "resnet_dt": False,
    "set_davg_zero": True,
    "activation_function": "tanh",
    "env_protection": 0.0,
    "smooth": True,
    "exclude_types": [],
    "precision": "default",
    "trainable": True,
    "concat_output_tebd": True,
    "use_econf_tebd": False,
    "use_tebd_bias": True,
}


class DescriptorSeE3Tebd(MixedTypesDescriptor):
    """se_e3_tebd. Buffers ``davg``/``dstd`` (ntypes, sel, 4) float64."""

    type_name = "se_e3_tebd"
    aliases = ()
    defaults = {"type": "se_e3_tebd", **DEFAULTS}
    deepmd_types = ("se_e3_tebd",)
    # TorchScript: branches on these are resolved when the model is scripted
    __constants__ = ["strip", "smooth", "concat_output_tebd"]

    def __init__(
        self,
        ntypes: int,
        sel: int | list[int],
        rcut: float = 6.0,
        rcut_smth: float = 0.5,
        neuron: list[int] = (10, 20, 40),
        tebd_dim: int = 8,
        tebd_input_mode: str = "concat",
        resnet_dt: bool = False,
        set_davg_zero: bool = True,
        activation_function: str = "tanh",
        env_protection: float = 0.0,
        smooth: bool = True,
        exclude_types: list[list[int]] | None = None,
        precision: str = "default",
        trainable: bool = True,
        concat_output_tebd: bool = True,
        use_econf_tebd: bool = False,
        use_tebd_bias: bool = True,
        type_map: list[str] | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        where = f"model/descriptor ({self.type_name})"
        if tebd_input_mode not in ("concat", "strip"):
            raise MDTrainError(
                f"{where}/tebd_input_mode: {tebd_input_mode!r} is not concat or strip"
            )
        self.init_mixed(
            ntypes, sel, rcut, rcut_smth, env_protection, set_davg_zero, exclude_types,
            precision, where,
        )  # fmt: skip
        self.precision = precision
        self.neuron = [int(n) for n in neuron]
        self.ng, self.tebd_dim = self.neuron[-1], int(tebd_dim)
        self.strip, self.smooth = tebd_input_mode == "strip", bool(smooth)
        self.concat_output_tebd = bool(concat_output_tebd)
        self.activation = activation_name(activation_function, where)
        self.resnet_dt, self.trainable, self.type_map = bool(resnet_dt), bool(trainable), type_map
        self.type_embedding = TypeEmbedNet(
            ntypes, [tebd_dim], "linear", precision=precision, trainable=trainable,
            seed=child_seed(seed, 1), padding=True, use_econf_tebd=use_econf_tebd,
            use_tebd_bias=use_tebd_bias, type_map=type_map,
        )  # fmt: skip
        args = (self.activation, resnet_dt, True, self.dtype)
        net_in = 1 if self.strip else 1 + 2 * self.tebd_dim
        self.embedding = DenseNet(net_in, self.neuron, *args, child_seed(seed, 0), trainable)
        self.embedding_strip = (
            DenseNet(2 * self.tebd_dim, self.neuron, *args, child_seed(seed, 2), trainable)
            if self.strip
            else None
        )

    @classmethod
    def from_config(cls, desc: dict, ntypes: int, type_map: list[str] | None = None):
        """From a filled ``model.descriptor`` section (``sel`` resolved to numbers)."""
        unknown = sorted(set(desc) - set(DEFAULTS) - {"type", "sel", "seed"})
        if unknown:
            raise MDTrainError(f"model/descriptor (se_e3_tebd): unknown key {unknown[0]!r}")
        settings = {**DEFAULTS, **{k: v for k, v in desc.items() if k != "type"}}
        return cls(ntypes, type_map=type_map, **settings)

    def to_config(self) -> dict:
        """The filled ``model.descriptor`` section that builds this descriptor, ``seed`` left out."""
        values = {
            "rcut": self.rcut, "rcut_smth": self.rcut_smth, "neuron": list(self.neuron),
            "tebd_dim": self.tebd_dim, "tebd_input_mode": "strip" if self.strip else "concat",
            "resnet_dt": self.resnet_dt, "set_davg_zero": self.set_davg_zero,
            "activation_function": self.activation, "env_protection": self.env_protection,
            "smooth": self.smooth, "exclude_types": [list(p) for p in self.exclude_types],
            "precision": self.precision, "trainable": self.trainable,
            "concat_output_tebd": self.concat_output_tebd, "use_econf_tebd": False,
            "use_tebd_bias": self.type_embedding.net.layers[0].bias is not None,
        }  # fmt: skip
        kept = (k for k in DEFAULTS if k != "seed")
        return {"type": self.type_name, "sel": self.nnei, **{k: values[k] for k in kept}}

    @property
    def dim_out(self) -> int:
        return self.ng + (self.tebd_dim if self.concat_output_tebd else 0)

    def forward(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """D (nf, N, dim_out) from ``diff`` (nf, N, sel, 3), ``nlist`` (nf, N, sel) with -1
        padding and ``atype`` (N,).

        The sum runs over the pairs of real, kept slots of each centre only (``pair_slots``),
        equal to the plain sum over all ``sel²`` (``DescriptorSeE3TebdPadded``) to rounding:
        a padded or excluded slot has the angular row 0 (padding: ``−davg/dstd`` with the
        angular davg 0, as the statistics give it; otherwise every slot enters), so its
        terms ``e·G`` are exactly 0; a pair (k, j) whose term equals that of (j, k) is left out
        and (j, k) counted twice (``pair_slots``). The net runs as ``pair_embedding``."""
        nf, natoms, nnei = nlist.shape
        rr, sw, valid = self.normalized_rows(diff, nlist, atype)
        tebd = self.type_embedding()
        nei_type = atype[torch.where(valid, nlist, 0)].reshape(-1)  # empty slots: atom 0's
        real = valid
        if bool((self.davg[:, :, 1:] != 0).any()):  # padded rows nonzero: every slot enters
            real = torch.ones_like(valid)
        centre, fj, fk, twice = self.pair_slots(real.reshape(-1, nnei), nei_type.view(-1, nnei))
        a = rr[..., 1:].reshape(-1, 3)
        e = (a.index_select(0, fj) * a.index_select(0, fk)).sum(dim=-1, keepdim=True)
        tj, tk = nei_type.index_select(0, fj), nei_type.index_select(0, fk)
        weight = 1.0 + twice.to(e.dtype).unsqueeze(-1)
        if not self.strip:
            g = self.pair_embedding(e, tebd, tj, tk) * weight
        else:  # G_jk + G_kj = G_e(e_jk)·(2 + G_t(T_j, T_k)·w_j·w_k + G_t(T_k, T_j)·w_k·w_j)
            n = tebd.shape[0]
            pairs = torch.cat(
                [tebd.unsqueeze(1).expand(n, n, -1), tebd.unsqueeze(0).expand(n, n, -1)], -1
            )
            table = self.embedding_strip(pairs).reshape(n * n, self.ng)
            g_t = table.index_select(0, tj * n + tk) + table.index_select(0, tk * n + tj) * (
                weight - 1.0
            )
            if self.smooth:
                w = sw.reshape(-1)
                g_t = g_t * (w.index_select(0, fj) * w.index_select(0, fk)).unsqueeze(-1)
            g = self.pair_embedding(e, tebd, tj, tk) * (g_t + weight)
        d = torch.zeros(nf * natoms, self.ng, dtype=rr.dtype, device=rr.device)
        d = d.index_add(0, centre, e * g).view(nf, natoms, self.ng) / float(nnei * nnei)
        if self.concat_output_tebd:
            d = torch.cat([d, take(tebd, atype).unsqueeze(0).expand(nf, -1, -1)], dim=-1)
        return d

    def for_export(self) -> "DescriptorSeE3Tebd":
        """This descriptor summing every pair of slots (`mdtrain.model.export_form`): the
        pairs of real slots are a size read from values."""
        return recast(self, DescriptorSeE3TebdPadded)

    def pair_slots(self, real: Tensor, types: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The pairs (j, k) of slots that are both ``real`` (B, sel), as the centre b of each,
        the flat slots ``b·sel + j`` and ``b·sel + k``, centre after centre, and ``twice``:
        the pairs j < k that stand for (k, j) too. ``e_jk = e_kj``, and the net's input is
        symmetric too with "strip" (the type net's two orders are summed) and with "concat"
        where the two neighbours' ``types`` (B, sel) agree: there (k, j) is left out."""
        nnei = real.shape[1]
        lower = torch.ones(nnei, nnei, dtype=torch.bool, device=real.device).tril(-1)
        keep = real.unsqueeze(2) & real.unsqueeze(1)
        if self.strip:
            keep = keep & ~lower
        else:
            keep = keep & ~(lower & (types.unsqueeze(2) == types.unsqueeze(1)))
        index = torch.nonzero(keep)
        b, j, k = index[:, 0], index[:, 1], index[:, 2]
        fj, fk = b * nnei + j, b * nnei + k
        twice = j < k
        if not self.strip:
            flat = types.reshape(-1)
            twice = twice & (flat.index_select(0, fj) == flat.index_select(0, fk))
        return b, fj, fk, twice

    def pair_embedding(self, e: Tensor, tebd: Tensor, tj: Tensor, tk: Tensor) -> Tensor:
        """The embedding net on the pairs (P of them): of ``e`` (P, 1) with "strip", of
        ``[e, T_tj, T_tk]`` with "concat" without building that input (the first product is
        ``e·W_e + (T W_j)[tj] + (T W_k)[tk]``, the last two one table over the type pairs,
        unless that layer has a skip, which needs the input itself). The doubled skips are
        built by a cat (``network.residual_by_cat``): the same values as the net's forward."""
        n, dim = tebd.shape
        x = e
        first = True
        for layer in self.embedding.layers:
            skip = 0
            if layer.resnet and layer.n_out == layer.n_in:
                skip = 1
            elif layer.resnet and layer.n_out == 2 * layer.n_in:
                skip = 2
            w = layer.weight
            bias = layer.bias
            if first and not self.strip and skip == 0:
                table = torch.matmul(tebd, w[1 : 1 + dim]).unsqueeze(1) + torch.matmul(
                    tebd, w[1 + dim :]
                ).unsqueeze(0)
                if bias is not None:
                    table = table + bias
                z = torch.addcmul(table.reshape(n * n, -1).index_select(0, tj * n + tk), e, w[0:1])
            else:
                if first and not self.strip:
                    x = torch.cat([e, tebd.index_select(0, tj), tebd.index_select(0, tk)], -1)
                z = x * w if layer.n_in == 1 else torch.matmul(x, w)
                if bias is not None:
                    z = z + bias
            x = residual_by_cat(z, x, layer.activation, layer.idt, skip)
            first = False
        return x

    def deepmd_dict(self) -> dict:
        """DeePMD-kit's serialised form (``DescrptSeTTebd.serialize()``'s keys)."""
        act = "none" if self.activation == "linear" else self.activation
        data = {
            "@class": "Descriptor", "type": "se_e3_tebd", "@version": 1, "rcut": self.rcut,
            "rcut_smth": self.rcut_smth, "sel": list(self.sel), "ntypes": self.ntypes,
            "neuron": list(self.neuron), "tebd_dim": self.tebd_dim,
            "tebd_input_mode": "strip" if self.strip else "concat",
            "set_davg_zero": self.set_davg_zero, "activation_function": act,
            "resnet_dt": self.resnet_dt, "concat_output_tebd": self.concat_output_tebd,
            "use_econf_tebd": False, "type_map": self.type_map,
            "precision": DTYPE_NAMES[self.dtype], "embeddings": net_collection(self.embedding, self.ntypes),
            "env_mat": {"rcut": self.rcut, "rcut_smth": self.rcut_smth,
                        "protection": self.env_protection, "use_exp_switch": False},
            "type_embedding": self.type_embedding.to_deepmd(),
            "exclude_types": [list(p) for p in self.exclude_types],
            "env_protection": self.env_protection, "smooth": self.smooth,
            "@variables": self.stats_to_deepmd(),
            "trainable": self.trainable,
        }  # fmt: skip
        if self.strip:
            data["embeddings_strip"] = net_collection(self.embedding_strip, self.ntypes)
        return data

    @classmethod
    def from_deepmd_dict(cls, data: dict, where: str = "descriptor") -> "DescriptorSeE3Tebd":
        """From DeePMD-kit's serialised se_e3_tebd dict, refusing by name what it cannot run."""
        if data.get("type") != "se_e3_tebd":
            raise MDTrainError(f"{where}: type {data.get('type')!r} is not se_e3_tebd")
        refuse_unsupported(data, where)
        names = ("rcut", "rcut_smth", "neuron", "tebd_dim", "tebd_input_mode", "resnet_dt",
                 "set_davg_zero", "activation_function", "env_protection", "smooth",
                 "exclude_types", "trainable", "concat_output_tebd", "type_map")  # fmt: skip
        settings = {k: data[k] for k in names if k in data}
        tebd = data["type_embedding"]
        settings["precision"] = configured_precision(data, where)
        desc = cls(int(data["ntypes"]), data["sel"], **settings)
        desc.type_embedding = TypeEmbedNet.from_deepmd(tebd, f"{where}/type_embedding")
        for key, attr in (("embeddings", "embedding"), ("embeddings_strip", "embedding_strip")):
            if getattr(desc, attr) is not None:
                net = one_net(data, key, desc.dtype, where)
                if net.n_in != getattr(desc, attr).n_in or net.dim_out != desc.ng:
                    raise MDTrainError(f"{where}/{key}: widths do not match neuron and tebd_dim")
                setattr(desc, attr, net)
        desc.stats_from_deepmd(data["@variables"], where)
        for p in desc.parameters():
            p.requires_grad_(p.requires_grad and desc.trainable)
        return desc


class DescriptorSeE3TebdPadded(DescriptorSeE3Tebd):
    """The plain se_e3_tebd sum over every pair of slots, padding included: the reference the
    sum over real slots (``DescriptorSeE3Tebd.forward``) is tested against."""

    def forward(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """D (nf, N, dim_out): the sum over every pair of the ``sel`` slots."""
        nf, natoms, nnei = nlist.shape
        rr, sw, valid = self.normalized_rows(diff, nlist, atype)
        a = rr[..., 1:]
        env = torch.matmul(a, a.transpose(-1, -2)).unsqueeze(-1)  # (nf, N, j, k, 1)
        tebd = self.type_embedding()
        nei_type = atype[torch.where(valid, nlist, 0)]  # empty slots: atom 0's type
        shape = (nf, natoms, nnei, nnei, self.tebd_dim)
        if not self.strip:
            t_j = take(tebd, nei_type).unsqueeze(3).expand(shape)
            t_k = take(tebd, nei_type).unsqueeze(2).expand(shape)
            g = self.embedding(torch.cat([env, t_j, t_k], dim=-1))
        else:
            n, width = tebd.shape  # pairs (j, k) -> [T_j, T_k]
            pairs = torch.cat(
                [tebd.unsqueeze(1).expand(n, n, width), tebd.unsqueeze(0).expand(n, n, width)], -1
            )
            g_t = take_pairs(
                self.embedding_strip(pairs), nei_type.unsqueeze(3), nei_type.unsqueeze(2)
            )
            if self.smooth:
                g_t = g_t * sw.unsqueeze(3) * sw.unsqueeze(2)
            g_s = self.embedding(env)
            g = g_s * g_t + g_s
        d = (env * g).sum(dim=(2, 3)) / float(nnei * nnei)
        if self.concat_output_tebd:
            d = torch.cat([d, take(tebd, atype).unsqueeze(0).expand(nf, -1, -1)], dim=-1)
        return d

    def for_export(self) -> "DescriptorSeE3TebdPadded":
        return self  # every slot already
