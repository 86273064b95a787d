"""DeePMD-kit's serialised form (``.dp``) of the se_e2 descriptors (se_e2_a, se_e2_r), both
ways: the same keys, an ``embeddings`` collection of nets indexed ``centre + neighbour·ntypes``
(or by neighbour with ``type_one_side``) and davg/dstd of shape (ntypes, sum(sel), ncols)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mdtrain.model.deepmd_nets import (
    PRECISION_NAMES,
    Reader,
    activation_in,
    activation_out,
    collection_dict,
    embedding_net_dict,
    network_layers,
    precision_in,
    to_numpy,
)


def se_to_deepmd(
    desc, cfg: dict, type_map: list[str], kind: str, slots: list[int] | None = None
) -> dict:
    """The descriptor dict DeePMD-kit's ``serialize`` writes for an se_e2 descriptor
    ``desc`` built from the normalised section ``cfg``; ``kind`` its serialised type.
    ``slots``: for a descriptor with nets for some (ti, tj) only (se_e3), its net at each
    collection index ti + tj·ntypes, -1 where DeePMD-kit keeps an unused net of zeros."""
    act = activation_out(cfg["activation_function"], "model/descriptor")
    dtype = desc.dtype
    nets = [embedding_net_dict(net, cfg["neuron"], cfg, act) for net in desc.networks]
    if slots is not None:
        nets = [nets[k] if k >= 0 else zeroed(nets[0]) for k in slots]
    out = {
        "@class": "Descriptor",
        "type": kind,
        "@version": 2,
        "rcut": float(desc.rcut),
        "rcut_smth": float(desc.rcut_smth),
        "sel": list(desc.sel),
        "neuron": [int(n) for n in cfg["neuron"]],
        "resnet_dt": bool(cfg["resnet_dt"]),
        "trainable": bool(cfg["trainable"]),
        "type_one_side": bool(desc.type_one_side),
        "exclude_types": [list(p) for p in desc.exclude_types],
        "env_protection": float(desc.env_protection),
        "set_davg_zero": bool(desc.set_davg_zero),
        "activation_function": act,
        "precision": PRECISION_NAMES[dtype],
        "spin": None,
        "env_mat": {
            "rcut": float(desc.rcut),
            "rcut_smth": float(desc.rcut_smth),
            "protection": float(desc.env_protection),
            "use_exp_switch": False,
        },
        "embeddings": collection_dict(
            nets, 1 if desc.type_one_side else 2, desc.ntypes, "embedding_network"
        ),
        "@variables": {"davg": to_numpy(desc.davg, dtype), "dstd": to_numpy(desc.dstd, dtype)},
        "type_map": list(type_map),
    }
    return out


def zeroed(net: dict) -> dict:
    """A copy of a net's dict with every array 0 (DeePMD-kit's cleared net)."""
    layers = [
        {
            **lay,
            "@variables": {
                k: None if v is None else np.zeros_like(v) for k, v in lay["@variables"].items()
            },
        }
        for lay in net["layers"]
    ]
    return {**net, "layers": layers}


def se_from_deepmd(
    r: Reader, d: dict, state: dict, ncols: int, slots: list[int] | None = None
) -> dict[str, Any]:
    """The settings every se_e2 descriptor shares, read from DeePMD-kit's dict ``d``; its
    nets and davg/dstd (``ncols`` columns) go into ``state``. ``slots`` as for
    ``se_to_deepmd``: which collection entries are read, into which net."""
    where = "model/descriptor"
    r.off(d, "spin", where, "a spin model")
    env = d.get("env_mat") or {}
    if env.get("use_exp_switch"):
        raise r.fail(f"{where}/env_mat/use_exp_switch", "the exponential switch is not supported")
    ntypes = len(r.get(d, "sel", where))
    type_one_side = bool(d.get("type_one_side", False))
    collection = r.get(d, "embeddings", where)
    nets = r.get(collection, "networks", f"{where}/embeddings")
    expected = ntypes if type_one_side else ntypes * ntypes
    if len(nets) != expected:
        raise r.fail(f"{where}/embeddings", f"{len(nets)} networks, expected {expected}")
    activation = activation_in(r, d.get("activation_function", "tanh"), where)
    for k, net in enumerate(nets):
        if slots is not None and slots[k] < 0:
            continue
        prefix = f"descriptor.networks.{k if slots is None else slots[k]}"
        network_layers(r, net, f"{where}/embeddings/networks/{k}", prefix, state)
    variables = r.get(d, "@variables", where)
    nnei = sum(int(s) for s in d["sel"])
    for key in ("davg", "dstd"):
        arr = r.array(variables, key, where).astype(np.float64)
        if arr.size != ntypes * nnei * ncols:
            raise r.fail(f"{where}/@variables/{key}", f"shape {arr.shape} does not fit sel")
        state[f"descriptor.{key}"] = torch.from_numpy(arr.reshape(ntypes, nnei, ncols))
    return {
        "sel": [int(s) for s in d["sel"]],
        "rcut": float(r.get(d, "rcut", where)),
        "rcut_smth": float(r.get(d, "rcut_smth", where)),
        "neuron": [int(n) for n in r.get(d, "neuron", where)],
        "activation_function": activation,
        "resnet_dt": bool(d.get("resnet_dt", False)),
        "type_one_side": type_one_side,
        "precision": precision_in(r, d.get("precision", "float64"), where),
        "trainable": bool(d.get("trainable", True)),
        "exclude_types": [[int(a), int(b)] for a, b in d.get("exclude_types") or []],
        "env_protection": float(d.get("env_protection", 0.0)),
        "set_davg_zero": bool(d.get("set_davg_zero", False)),
        "seed": None,
    }
