"""The length of a training given in epochs (``training.numb_epoch``), in steps, counted as
DeePMD-kit's PyTorch trainer counts them.

DeePMD-kit 3.2 sets ``numb_steps = ceil(numb_epoch * ceil(max_i(nbatch_i / p_i)))``
(``compute_total_numb_batch``), where ``nbatch_i`` is the number of batches of one pass over
system ``i`` on one rank (``ceil(nframes_i / (ranks * batch_size_i))``, the length of its
per-rank data loader) and ``p_i`` the system's sampling probability. The probabilities are
recomputed here in DeePMD-kit's own order of floating-point operations rather than taken
from the sampler: the ceiling of a quotient that is an integer in exact arithmetic may land
on either side of it, and it must land where DeePMD-kit's does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from mdtrain.errors import MDTrainError
from mdtrain.train.sampler import TrainingSampler, batches_per_epoch

log = logging.getLogger("mdtrain")


def deepmd_system_weights(
    nbatch: Sequence[int], sys_probs: Sequence[float] | None, auto_prob: str
) -> np.ndarray:
    """The system weights of DeePMD-kit's weighted sampler (``process_sys_probs`` /
    ``prob_sys_size_ext``), before its final normalisation."""
    nb = np.asarray(nbatch, dtype=np.int64)
    if sys_probs is not None:
        given = np.array(sys_probs, dtype=np.float64)
        assigned = given >= 0
        rest = 1.0 - np.sum(assigned * given)
        if np.isclose(rest, 0):
            return given
        rest_nbatch = (1 - assigned) * nb
        return rest * rest_nbatch / np.sum(rest_nbatch) + assigned * given
    if auto_prob == "prob_uniform":
        return np.array([1.0 / float(len(nb))] * len(nb))
    style = f"prob_sys_size;0:{len(nb)}:1.0" if auto_prob == "prob_sys_size" else auto_prob
    blocks = [part.split(":") for part in style.split(";")[1:]]
    weights = np.array([float(w) for _, _, w in blocks])
    block_probs = weights / np.sum(weights)
    probs = np.zeros(len(nb), dtype=np.float64)
    for (start, stop, _), share in zip(blocks, block_probs, strict=True):
        part = nb[int(start) : int(stop)]
        probs[int(start) : int(stop)] = [float(i) for i in part] / np.sum(part) * share
    return probs


def batches_per_epoch_total(nbatch: Sequence[int], weights: np.ndarray) -> int:
    """``ceil(max_i(nbatch_i / p_i))`` over the systems with ``p_i > 0``."""
    probs = np.asarray(weights, dtype=np.float64)
    probs = probs / float(np.sum(probs))
    nb = np.asarray(nbatch, dtype=np.float64)
    valid = probs > 0.0
    return int(np.ceil(np.max(nb[valid] / probs[valid])))


def steps_for_epochs(
    numb_epoch: float,
    nbatch: Sequence[int],
    sys_probs: Sequence[float] | None = None,
    auto_prob: str = "prob_sys_size",
) -> int:
    """Training steps for ``numb_epoch`` passes over the data (``nbatch``: batches per pass of
    each system on one rank)."""
    if not numb_epoch > 0:
        raise MDTrainError(f"training.numb_epoch must be > 0, got {numb_epoch}")
    total = batches_per_epoch_total(nbatch, deepmd_system_weights(nbatch, sys_probs, auto_prob))
    return int(math.ceil(float(numb_epoch) * total))


def run_length(training: dict, sampler: TrainingSampler) -> int:
    """``training.numb_steps``, or the steps of ``training.numb_epoch`` for this sampler's
    systems, batch sizes and ranks."""
    if training.get("numb_steps") is not None:
        return int(training["numb_steps"])
    nbatch = batches_per_epoch(sampler.nframes, sampler.batch_sizes, sampler.world_size)
    data = training["training_data"]
    steps = steps_for_epochs(
        training["numb_epoch"],
        nbatch,
        data.get("sys_probs"),
        data.get("auto_prob", "prob_sys_size"),
    )
    log.info("training.numb_epoch %g: %d steps", training["numb_epoch"], steps)
    return steps
