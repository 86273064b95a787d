"""The output bias of a polar model (the atomic model's ``out_bias`` of DeePMD-kit, of which a
polar model with ``shift_diag`` uses the mean diagonal per type), from the statistics frames.

With atomic labels (``atomic_polarizability``): per type, the mean atomic tensor over the
sampled atoms of that type. Otherwise, from the frame labels: the least-squares per-type
tensor ``lstsq(N, T)`` (``N`` the atoms of each selected type per frame), as the energy bias
is fitted. Excluded types get zero. Dipole models apply no bias (DeePMD-kit's neither).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def tensor_out_bias(model, systems: Sequence[Any], plan: list[tuple[int, int, int]]) -> np.ndarray:
    """(ntypes, size) float64; zeros when no sampled frame has a label of the model's tensor."""
    ntypes, size, label = model.ntypes, model.tensor_size, model.label
    keep = model.atom_keep.cpu().numpy()
    sums, counts = np.zeros((ntypes, size)), np.zeros(ntypes)
    rows, targets = [], []
    spans: dict[int, list[int]] = {}
    for index, start, stop in plan:
        spans.setdefault(index, []).extend(range(start, stop))
    for index, frames in spans.items():
        system = systems[index]
        data = system.frames(frames, labels=(label, f"atomic_{label}"), positions=False)
        per_type = np.bincount(system.atype, minlength=ntypes) * keep
        if f"atomic_{label}" in data:
            atomic = data[f"atomic_{label}"]  # (n, N, size)
            for t in range(ntypes):
                mask = system.atype == t
                sums[t] += atomic[:, mask].sum(axis=(0, 1))
                counts[t] += atomic.shape[0] * mask.sum()
        elif label in data:
            rows += [per_type] * len(frames)
            targets.append(data[label])
    if counts.any():
        bias = sums / np.maximum(counts, 1)[:, None]
    elif rows:
        bias = np.linalg.lstsq(np.array(rows), np.concatenate(targets), rcond=None)[0]
    else:
        return np.zeros((ntypes, size))
    return bias * keep[:, None]
