"""How ranks split the statistics (``training.distributed.stat_mode: "shard"``): this rank's
share, a sum over ranks and a run-on-rank-0, bound to the collectives in ``train/prepare.py``."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


def _same(array: np.ndarray) -> np.ndarray:
    return array


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@dataclass(frozen=True)
class StatShare:
    """This process's part of statistics that ``world`` ranks compute together.

    Rank ``rank`` takes a contiguous share of the statistics batches (``share_ranges``);
    ``total`` sums a float64 array over the ranks (an all-reduce), and ``on_main`` runs a
    function on rank 0 and hands its result, or its failure, to every rank (the stat file is
    read and written there). The default is one process doing everything, the same code
    path: the numbers differ between world sizes only by rounding (the order of float64
    additions, the QR factors of the energy bias combined), about 1e-15 relative.
    """

    rank: int = 0
    world: int = 1
    total: Callable[[np.ndarray], np.ndarray] = _same
    on_main: Callable[..., Any] = _call


ALONE = StatShare()
