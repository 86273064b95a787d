"""A pretrained model's weights and statistics under a new type_map, network by network
(fine-tuning, `mdtrain.train.finetune`).

``mapping[t]`` is the pretrained index of new type t (None: an element new to it). Each
network of a model (the model itself, the DP part of DP+ZBL, each network part of a
``linear_ener`` model: `network_parts`) is mapped as a model of its own, and a hybrid
descriptor member by member, each with its own ``sel`` (DeePMD-kit's ``change_type_map``
goes down the same tree):

- per-type embedding nets: by neighbour type (``type_one_side``), by (centre, neighbour)
  pair, or (se_e3) by unordered pair of neighbour types, which are symmetric;
- a type-embedding descriptor: every net is shared by all types, so all of them are the
  pretrained ones except the type embedding's rows of new types;
- davg/dstd: rows of known centre types, neighbour block by neighbour block (``sel`` of
  the block may differ), whole rows for a type-mixed list;
- fitting nets by type, or the one shared net; the fitting's other buffers (frame
  parameter statistics) as they are;
- ``out_bias``/``out_std`` (the model's and any part's) by type, 0 and 1 for new types.
"""

from __future__ import annotations

import numpy as np
import torch

from mdtrain.config.model_kind import LINEAR, STANDARD, model_type
from mdtrain.model.descriptors.se_e3 import type_pairs


def network_parts(model_config: dict) -> list[tuple[str, dict]]:
    """``(state-dict prefix, section)`` of each network (descriptor and fitting) of a model
    section: ``""`` for a standard model, ``parts.0.`` for DP+ZBL's network, ``parts.k.``
    for a ``linear_ener`` model's k-th part."""
    kind = model_type(model_config)
    if kind == LINEAR:
        return [
            (f"parts.{k}.", m)
            for k, m in enumerate(model_config.get("models") or [])
            if model_type(m) == STANDARD
        ]
    if kind == STANDARD:
        return [("parts.0." if "use_srtab" in model_config else "", model_config)]
    return []


def _copy_net(state: dict, old_state: dict, new_prefix: str, old_prefix: str) -> None:
    for key in [k for k in state if k.startswith(new_prefix + ".")]:
        state[key] = old_state[old_prefix + key[len(new_prefix) :]].clone()


def _net_pairs(desc: torch.nn.Module, mapping: list, n_old: int) -> list[tuple[int, int]]:
    """(new index, pretrained index) of the embedding nets of a per-type descriptor."""
    known = [(t, o) for t, o in enumerate(mapping) if o is not None]
    if hasattr(desc, "first") and hasattr(desc, "second"):  # se_e3: unordered type pairs
        new_pairs, old_pairs = type_pairs(len(mapping)), type_pairs(n_old)
        found = []
        for k, (a, b) in enumerate(new_pairs):
            oa, ob = mapping[a], mapping[b]
            if oa is not None and ob is not None:
                found.append((k, old_pairs.index((min(oa, ob), max(oa, ob)))))
        return found
    if desc.type_one_side:
        return known
    n_new = len(mapping)
    return [(c + t * n_new, oc + ot * n_old) for c, oc in known for t, ot in known]


def _one_hot_skip(ntypes: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """What a first layer's skip connection adds to the one-hot input of each type: the
    identity (width ntypes), two of them side by side (2 ntypes), or nothing."""
    eye = torch.eye(ntypes, dtype=dtype)
    if width == ntypes:
        return eye
    if width == 2 * ntypes:
        return torch.cat([eye, eye], dim=1)
    return torch.zeros(ntypes, width, dtype=dtype)


def _type_embedding(
    state: dict, old_state: dict, prefix: str, mapping: list, embedding: torch.nn.Module
) -> None:
    """Every parameter of a type-embedding descriptor from the pretrained one, but the
    rows of the type embedding's first layer (one per type, from a one-hot input) of types
    new to it, which stay fresh. Where that layer has a skip connection (``tebd_dim`` equal
    to the number of types or twice it) the skip adds the type's own one-hot vector, which
    moves with the index: as DeePMD-kit's ``change_type_map`` does, each row keeps its
    output by taking the old skip in and the new one out (exact: the layer is linear)."""
    rows = f"{prefix}type_embedding.net.layers.0.weight"
    first = embedding.net.layers[0]
    if first.activation != "linear" or first.idt is not None:
        raise ValueError(f"{rows}: only a linear type embedding without timestep is mapped")
    for key in [k for k in state if k.startswith(prefix)]:
        if key in (f"{prefix}davg", f"{prefix}dstd") or key not in old_state:
            continue
        if key != rows:
            state[key] = old_state[key].clone()
            continue
        old, new = old_state[key], state[key]
        old_skip, new_skip = (_one_hot_skip(*w.shape, w.dtype) for w in (old, new))
        for t, o in enumerate(mapping):
            if o is not None:
                new[t] = old[o] + old_skip[o] - new_skip[t] if first.resnet else old[o]


def _stats(state: dict, old_state: dict, prefix: str, mapping: list, old_sel, new_sel) -> None:
    """davg/dstd rows of known centre types, neighbour block by block (a block of a type
    new to the pretrained model takes the row's first value: the statistics are per centre
    type); ``old_sel`` None: a type-mixed list, whole rows."""
    for key in (f"{prefix}davg", f"{prefix}dstd"):
        old, new = old_state[key].to(torch.float64), state[key]
        if old_sel is None:
            for c, oc in enumerate(mapping):
                if oc is not None:
                    new[c] = old[oc]
            continue
        old_off = np.concatenate([[0], np.cumsum(old_sel)]).astype(int)
        new_off = np.concatenate([[0], np.cumsum(new_sel)]).astype(int)
        for c, oc in enumerate(mapping):
            if oc is None:
                continue
            for t, ot in enumerate(mapping):
                row = old[oc, old_off[ot]] if ot is not None and old_sel[ot] else old[oc, 0]
                new[c, new_off[t] : new_off[t + 1]] = row


def map_descriptor(
    state: dict, old_state: dict, prefix: str, desc: torch.nn.Module, old_cfg: dict,
    mapping: list, n_old: int,
) -> None:  # fmt: skip
    """The pretrained descriptor at ``prefix`` (its section ``old_cfg``) into ``state``,
    a hybrid member by member."""
    members = getattr(desc, "members", None)
    if members is not None:
        for k, member in enumerate(members):
            sub = f"{prefix}members.{k}."
            map_descriptor(state, old_state, sub, member, old_cfg["list"][k], mapping, n_old)
        return
    if desc.mixed_types:
        _type_embedding(state, old_state, prefix, mapping, desc.type_embedding)
        _stats(state, old_state, prefix, mapping, None, None)
        return
    for new, old in _net_pairs(desc, mapping, n_old):
        _copy_net(state, old_state, f"{prefix}networks.{new}", f"{prefix}networks.{old}")
    _stats(state, old_state, prefix, mapping, list(old_cfg["sel"]), list(desc.sel))


def map_network(
    state: dict, old_state: dict, prefix: str, net: torch.nn.Module, old_cfg: dict,
    mapping: list, n_old: int,
) -> None:  # fmt: skip
    """The pretrained network (descriptor and fitting) at ``prefix`` into ``state``."""
    map_descriptor(
        state, old_state, f"{prefix}descriptor.", net.descriptor, old_cfg["descriptor"],
        mapping, n_old,
    )  # fmt: skip
    fit = f"{prefix}fitting."
    for key in [k for k in state if k.startswith(fit) and not k.startswith(f"{fit}networks.")]:
        if key in old_state and old_state[key].shape == state[key].shape:
            state[key] = old_state[key].clone()  # not per type: frame-parameter statistics
    if net.fitting.mixed_types:  # one net for all types: the pretrained one as it is
        if any(o is not None for o in mapping):
            _copy_net(state, old_state, f"{fit}networks.0", f"{fit}networks.0")
        return
    for t, o in enumerate(mapping):
        if o is not None:
            _copy_net(state, old_state, f"{fit}networks.{t}", f"{fit}networks.{o}")


def map_biases(state: dict, old_state: dict, mapping: list) -> None:
    """Every ``out_bias``/``out_std`` (the model's, a part's) by type: new types 0 and 1."""
    for key in [k for k in state if k.rsplit(".", 1)[-1] in ("out_bias", "out_std")]:
        if key not in old_state:
            continue
        old = old_state[key].to(state[key].dtype)
        fresh = 0.0 if key.endswith("out_bias") else 1.0
        new = torch.full_like(state[key], fresh)
        for t, o in enumerate(mapping):
            if o is not None:
                new[t] = old[o]
        state[key] = new
