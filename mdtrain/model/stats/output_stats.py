"""The output statistics of a DOS or property model (DeePMD-kit 3.2's ``compute_output_stats``
with ``set-by-statistic``: ``deepmd/pt/utils/stat.py``, ``deepmd/utils/out_stat.py``), from
the statistics frames: the atomic model's ``out_bias`` and ``out_std``, (ntypes, k).

- Systems with atomic labels (``atom_<name>.npy``): per type, the mean and standard deviation
  of the atomic values of that type's sampled atoms.
- Systems with frame labels (``<name>.npy``), with ``N`` the atoms of each type per frame
  (``atom_exclude_types`` not counted), divided by their total for an ``intensive`` output:
  ``distinguish_types`` (DOS always): the least-squares ``bias = lstsq(N, y, rcond)``, and
  one standard deviation (over frames) of the residual ``y - N bias`` for all types; without
  it (a property that asks): the mean and standard deviation over frames of ``y`` (divided by
  the atoms for an extensive one), the same for every type.

The atomic statistics win where a type has atomic values; the frame statistics fill the
types that have none (NaN left where neither has any, then zero, as DeePMD-kit's fill does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def output_stats(
    model,
    systems: Sequence[Any],
    plan: list[tuple[int, int, int]],
    rcond: float | None = None,
    predict: Callable[[int, list[int]], dict[str, np.ndarray]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(out_bias, out_std)`` (ntypes, k) float64 of ``model`` (an `InvariantModel`) over the
    frames of ``plan`` ((system, start, stop) rows); zeros and ones when no frame has a
    label. With ``predict(system index, frames)`` (the model's outputs ``<name>`` (nf, k) and
    ``atom_<name>`` (nf, N, k) on those frames) the statistics are those of the labels minus
    the predictions: the shift of ``change-bias -m change`` (DeePMD-kit's
    ``change-by-statistic``)."""
    ntypes, width, name = model.ntypes, model.width, model.output
    keep = model.atom_keep.cpu().numpy()
    atomic: list[list[np.ndarray]] = [[] for _ in range(ntypes)]
    counts: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    spans: dict[int, list[int]] = {}
    for index, start, stop in plan:
        spans.setdefault(index, []).extend(range(start, stop))
    for index, frames in spans.items():
        system = systems[index]
        data = system.frames(frames, labels=(name, f"atom_{name}"), positions=False)
        if predict is not None:
            pred = predict(index, frames)
            data = {k: v - pred[k].reshape(v.shape) for k, v in data.items() if k in pred}
        if f"atom_{name}" in data:
            values = data[f"atom_{name}"].reshape(len(frames), system.natoms, width)
            for t in range(ntypes):
                atomic[t].append(values[:, system.atype == t].reshape(-1, width))
        if name in data:
            per_type = np.bincount(system.atype, minlength=ntypes)[:ntypes] * keep
            counts.append(np.tile(per_type.astype(np.float64), (len(frames), 1)))
            targets.append(data[name].reshape(len(frames), width))
    bias = std = None
    if any(atomic[t] for t in range(ntypes)):
        bias, std = _atomic_stats(atomic, width)
    if counts:
        natoms, y = np.concatenate(counts), np.concatenate(targets)
        if model.distinguish_types:
            g_bias, g_std = _least_squares(natoms, y, rcond, model.intensive)
        else:
            g_bias, g_std = _mean_over_frames(natoms, y, model.intensive)
        if bias is None:
            bias, std = g_bias, g_std
        else:
            bias = np.where(np.isnan(bias) & ~np.isnan(g_bias), g_bias, bias)
            std = np.where(np.isnan(std) & ~np.isnan(g_std), g_std, std)
    if bias is None:
        return np.zeros((ntypes, width)), np.ones((ntypes, width))
    return np.nan_to_num(bias), np.nan_to_num(std)


def _atomic_stats(values: list[list[np.ndarray]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-type mean and standard deviation of the atomic values (NaN for a type without)."""
    ntypes = len(values)
    bias, std = np.full((ntypes, width), np.nan), np.full((ntypes, width), np.nan)
    for t, parts in enumerate(values):
        rows = np.concatenate(parts) if parts else np.zeros((0, width))
        if len(rows):
            bias[t], std[t] = rows.mean(axis=0), rows.std(axis=0)
    return bias, std


def _least_squares(
    natoms: np.ndarray, y: np.ndarray, rcond: float | None, intensive: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Per-type bias of the frame values by least squares, and the residual's std (per
    value, the same for every type)."""
    if intensive:
        natoms = natoms / natoms.sum(axis=1, keepdims=True)
    bias = np.linalg.lstsq(natoms, y, rcond=rcond)[0]
    std = (y - natoms @ bias).std(axis=0)
    return bias, np.tile(std, (natoms.shape[1], 1))


def _mean_over_frames(
    natoms: np.ndarray, y: np.ndarray, intensive: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One mean and std over frames for every type (per atom for an extensive output)."""
    if not intensive:
        y = y / natoms.sum(axis=1, keepdims=True)
    ntypes = natoms.shape[1]
    return np.tile(y.mean(axis=0), (ntypes, 1)), np.tile(y.std(axis=0), (ntypes, 1))
