"""The reference of the descriptor statistics: sums over the padded neighbour lists, slot by
slot, the way DeePMD-kit takes them. Production sums pairs (``mdtrain.model.stats.pairs``);
the tests check that both agree for every registered descriptor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from mdtrain.memory import InferenceChunker
from mdtrain.model.stats import StatItem, model_device, stat_inputs


def descriptor_stat_sums(model, coord, box, atype, nlist, shift) -> torch.Tensor:
    """(ntypes, ngroups, 3) float64 on the inputs' device: per centre type and for each of
    the descriptor's ``stat_groups``, [number, sum, squared sum] of the raw environment
    matrix's entries (exclusions zeroed, padding slots counted as zeros).

    Tensor maths only (no value read, no boolean mask), so that it runs on any device, the
    ``meta`` device included.
    """
    diff = model.pair_vectors(coord, box, nlist, shift)
    desc = model.descriptor
    if hasattr(desc, "member_lists"):  # a hybrid: each member on its slots of the list
        lists = desc.member_lists(diff, nlist, atype)
        parts = [
            _sums(member, m_diff, m_nlist, atype)
            for member, (m_diff, m_nlist) in zip(desc.members, lists, strict=True)
        ]
        return torch.cat(parts, dim=1)
    return _sums(desc, diff, nlist, atype)


def _sums(desc, diff, nlist, atype) -> torch.Tensor:
    raw = desc.env_matrix(diff, nlist >= 0)
    raw = raw * desc.keep_mask(nlist, atype).unsqueeze(-1).to(raw.dtype)
    ones = torch.ones(raw.shape[1], dtype=raw.dtype, device=raw.device)
    centres = raw.new_zeros(desc.ntypes).index_add_(0, atype, ones)
    slots = centres * float(raw.shape[0] * raw.shape[2])  # frames · slots per centre
    groups = []
    for a, b in desc.stat_columns:
        part = raw[..., a:b]
        per_atom = torch.stack([part.sum(dim=(0, 2, 3)), (part * part).sum(dim=(0, 2, 3))], 1)
        sums = per_atom.new_zeros(desc.ntypes, 2).index_add_(0, atype, per_atom)
        groups.append(torch.stack([float(b - a) * slots, sums[:, 0], sums[:, 1]], dim=1))
    return torch.stack(groups, dim=1)


def descriptor_stat_items(batches: Iterable[dict[str, Any]], model) -> dict[str, StatItem]:
    """The ``<group>_<type>`` items over padded batches (``collect_stat_batches``), on the
    model's device, in chunks that adapt to the memory available."""
    desc = model.descriptor
    device = model_device(model)
    items = {f"{k}_{t}": StatItem() for t in range(desc.ntypes) for k in desc.stat_groups}
    chunker = InferenceChunker(device=device)

    def chunk_items(batch: dict[str, Any], start: int, stop: int) -> dict[str, StatItem]:
        values = descriptor_stat_sums(model, *stat_inputs(batch, start, stop, device))
        values = values.cpu().tolist()
        return {
            f"{k}_{t}": StatItem(*values[t][j])
            for t in range(desc.ntypes)
            for j, k in enumerate(desc.stat_groups)
        }

    with torch.no_grad():
        for batch in batches:
            nframes, natoms = batch["coord"].shape[0], batch["coord"].shape[1]
            parts = chunker.run_all(
                lambda a, b, batch=batch: chunk_items(batch, a, b),
                nframes, natoms, batch.get("system", ""),
            )  # fmt: skip
            for part in parts:
                for key, item in part.items():
                    items[key] += item
    return items


def compute_descriptor_stats(batches, model) -> tuple[np.ndarray, np.ndarray]:
    """davg and dstd of the model's descriptor over padded batches."""
    return model.descriptor.stats_from_items(descriptor_stat_items(batches, model))
