"""Statistics of the frame and atomic parameters (DeePMD-kit's ``compute_input_stats``).

Over the sampled frames (the same batches as the descriptor statistics): for each fparam
column, the mean and std over frames; for each aparam column, over every atom of those frames.
``std = sqrt(max(E[x^2] - E[x]^2, 0))``, replaced by ``data_stat_protect`` when smaller; the
fitting keeps ``avg`` and ``inv_std = 1 / std``. Systems without ``fparam.npy`` (read with
``default_fparam``) add nothing to the frame-parameter sums.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mdtrain.model.stats.share import ALONE, StatShare

log = logging.getLogger("mdtrain.model.stats")


def param_sums(
    systems: Sequence[Any], plan: list[tuple[int, int, int]], name: str, width: int
) -> np.ndarray:
    """``[count, sum (width), squared sum (width)]`` of ``name`` over the frames of ``plan``."""
    out = np.zeros(1 + 2 * width)
    for index, items in itertools.groupby(plan, key=lambda item: item[0]):
        system = systems[index]
        if not system.has(name):
            continue
        spans = [(start, stop) for _, start, stop in items]
        rows = np.arange(spans[0][0], spans[-1][1])
        values = system.frames(rows, labels=(name,), positions=False)[name].reshape(-1, width)
        out[0] += values.shape[0]
        out[1 : 1 + width] += values.sum(axis=0)
        out[1 + width :] += (values * values).sum(axis=0)
    return out


def avg_std(sums: np.ndarray, width: int, protect: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean and protected std per column from ``param_sums`` (mean 0, std 0.1 without data,
    as DeePMD-kit's ``StatItem``)."""
    count = sums[0]
    if count == 0:
        return np.zeros(width), np.full(width, 0.1)
    mean = sums[1 : 1 + width] / count
    std = np.sqrt(np.clip(sums[1 + width :] / count - mean * mean, 0.0, None))
    return mean, np.where(np.abs(std) < protect, protect, std)


def set_param_stats(
    model,
    systems: Sequence[Any],
    plan: list[tuple[int, int, int]],
    protect: float,
    share: StatShare = ALONE,
) -> None:
    """Install fparam/aparam statistics in ``model.fitting`` (nothing for a model without)."""
    fitting = model.fitting
    for name, width in (("fparam", fitting.numb_fparam), ("aparam", fitting.numb_aparam)):
        if width == 0:
            continue
        sums = share.total(param_sums(systems, plan, name, width))
        if sums[0] == 0 and share.rank == 0:
            log.warning("no sampled system has %s.npy: its statistics stay neutral", name)
        mean, std = avg_std(sums, width, protect)
        getattr(fitting, f"{name}_avg").copy_(torch.from_numpy(mean))
        getattr(fitting, f"{name}_inv_std").copy_(torch.from_numpy(1.0 / std))
        log.info(
            "%s statistics: mean %s, std %s",
            name,
            np.array2string(mean, precision=4),
            np.array2string(std, precision=4),
        )
