"""se_atten / se_atten_v2 to and from DeePMD-kit's serialised descriptor dict.

``to_deepmd(desc)`` gives the dict DeePMD-kit 3.2's ``DescrptDPA1.serialize()`` (or
``DescrptSeAttenV2``'s) writes, so ``DescrptDPA1.deserialize`` reads it; ``from_deepmd``
builds our descriptor from such a dict, refusing by name what it cannot run (compressed
tables, spin, the electronic-configuration type embedding).
"""

from __future__ import annotations

import numpy as np

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.attention import attention_to_deepmd
from mdtrain.model.descriptors.layers import DTYPE_NAMES, as_numpy, load
from mdtrain.model.descriptors.mixed_base import (
    configured_precision,
    net_collection,
    one_net,
    refuse_unsupported,
)
from mdtrain.model.descriptors.se_atten import DescriptorSeAtten, DescriptorSeAttenV2
from mdtrain.model.descriptors.type_embedding import TypeEmbedNet

# keys of the serialised dict that are constructor settings of ours, by the same name
_SETTINGS = (
    "rcut", "rcut_smth", "neuron", "axis_neuron", "tebd_dim", "set_davg_zero", "attn",
    "attn_layer", "attn_dotr", "activation_function", "resnet_dt", "scaling_factor",
    "normalize", "temperature", "trainable_ln", "ln_eps", "smooth_type_embedding",
    "type_one_side", "concat_output_tebd", "use_tebd_bias", "exclude_types",
    "env_protection", "trainable", "type_map",
)  # fmt: skip


def to_deepmd(desc: DescriptorSeAtten) -> dict:
    """DeePMD-kit's serialised form of ``desc`` (numpy arrays, DeePMD-kit's key names)."""
    s = desc.settings
    v2 = isinstance(desc, DescriptorSeAttenV2)
    act = s["activation_function"]
    data = {
        "@class": "Descriptor",
        "type": "se_atten_v2" if v2 else "dpa1",
        "@version": 4 if desc.lmax != 1 else 2,
        "rcut": desc.rcut,
        "rcut_smth": desc.rcut_smth,
        "sel": list(desc.sel),
        "ntypes": desc.ntypes,
        "neuron": list(s["neuron"]),
        "axis_neuron": desc.axis_neuron,
        "tebd_dim": desc.tebd_dim,
        "tebd_input_mode": "strip" if desc.strip else "concat",
        "set_davg_zero": desc.set_davg_zero,
        "attn": s["attn"],
        "attn_layer": s["attn_layer"],
        "attn_dotr": s["attn_dotr"],
        "attn_mask": False,
        "activation_function": "none" if act == "linear" else act,
        "resnet_dt": s["resnet_dt"],
        "scaling_factor": s["scaling_factor"],
        "normalize": s["normalize"],
        "temperature": s["temperature"],
        "trainable_ln": s["trainable_ln"],
        "ln_eps": s["ln_eps"],
        "smooth_type_embedding": desc.smooth,
        "type_one_side": desc.type_one_side,
        "concat_output_tebd": desc.concat_output_tebd,
        "use_econf_tebd": False,
        "use_tebd_bias": s["use_tebd_bias"],
        "type_map": s["type_map"],
        "precision": DTYPE_NAMES[desc.dtype],
        "embeddings": net_collection(desc.embedding, desc.ntypes),
        "attention_layers": attention_to_deepmd(desc.attention, desc.nnei, desc.ng, s),
        "env_mat": {
            "rcut": desc.rcut,
            "rcut_smth": desc.rcut_smth,
            "protection": desc.env_protection,
            "use_exp_switch": False,
        },
        "type_embedding": desc.type_embedding.to_deepmd(),
        "exclude_types": [list(p) for p in desc.exclude_types],
        "env_protection": desc.env_protection,
        "@variables": desc.stats_to_deepmd(),
        "trainable": s["trainable"],
        "spin": None,
    }
    if v2:
        del data["tebd_input_mode"], data["smooth_type_embedding"]
    if desc.lmax != 1:
        data["lmax"] = desc.lmax
        data["@variables"]["degree_gain_raw"] = as_numpy(desc.degree_gain)
    if desc.strip:
        data["embeddings_strip"] = net_collection(desc.embedding_strip, desc.ntypes)
    return data


def from_deepmd(data: dict, where: str = "descriptor") -> DescriptorSeAtten:
    """Our descriptor, weights and statistics from DeePMD-kit's serialised se_atten dict."""
    kind = data.get("type")
    if kind not in ("dpa1", "se_atten", "se_atten_v2"):
        raise MDTrainError(f"{where}: type {kind!r} is not se_atten (dpa1) or se_atten_v2")
    refuse_unsupported(data, where)
    settings = {k: data[k] for k in _SETTINGS if k in data}
    settings.setdefault("use_tebd_bias", True)  # version 1 files had biased type embeddings
    settings["precision"] = configured_precision(data, where)
    settings["lmax"] = data.get("lmax")
    ntypes, sel = int(data["ntypes"]), data["sel"]
    if kind == "se_atten_v2":
        desc = DescriptorSeAttenV2(ntypes, sel, **settings)
    else:
        settings["tebd_input_mode"] = data.get("tebd_input_mode", "concat")
        desc = DescriptorSeAtten(ntypes, sel, **settings)
    dtype = desc.dtype
    trainable = bool(data.get("trainable", True))
    desc.embedding = one_net(data, "embeddings", dtype, where)
    if desc.strip:
        desc.embedding_strip = one_net(data, "embeddings_strip", dtype, where)
    desc.type_embedding = TypeEmbedNet.from_deepmd(
        data["type_embedding"], f"{where}/type_embedding"
    )
    layers = (data.get("attention_layers") or {}).get("attention_layers") or []
    if len(layers) != len(desc.attention):
        raise MDTrainError(
            f"{where}/attention_layers: {len(layers)} layers, attn_layer says {len(desc.attention)}"
        )
    for k, (layer, layer_data) in enumerate(zip(desc.attention, layers)):
        layer.load_deepmd(layer_data, f"{where}/attention_layers/{k}")
    variables = data["@variables"]
    desc.stats_from_deepmd(variables, where)
    if desc.degree_gain is not None:
        load(desc.degree_gain, np.ravel(variables["degree_gain_raw"]), f"{where}/degree_gain_raw")
    for p in desc.parameters():
        p.requires_grad_(p.requires_grad and trainable)
    _check_widths(desc, where)
    return desc


def _check_widths(desc: DescriptorSeAtten, where: str) -> None:
    """The loaded networks fit the settings (a file edited by hand fails here, by name)."""
    tebd_in = desc.tebd_dim if desc.type_one_side else 2 * desc.tebd_dim
    want = 1 if desc.strip else 1 + tebd_in
    if desc.embedding.n_in != want or desc.embedding.dim_out != desc.ng:
        raise MDTrainError(f"{where}/embeddings: widths do not match neuron and tebd_dim")
    if desc.strip and desc.embedding_strip.n_in != tebd_in:
        raise MDTrainError(f"{where}/embeddings_strip: widths do not match tebd_dim")
    if desc.type_embedding.dim_out != desc.tebd_dim:
        raise MDTrainError(f"{where}/type_embedding: width is not tebd_dim")
