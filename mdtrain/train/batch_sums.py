"""The sums over a step's whole global batch that a loss needs before any micro-batch's
backward: the property loss's ``rmse``, the root of a mean over every rank's frames, is not a
sum of micro-batch or rank terms (`loss_property.PropertyLoss`).

Before the step, the batch is evaluated without gradients (in chunks that shrink on
out-of-memory, as inference does: the sums do not depend on them), each such loss's
``(S, G)`` is stacked, and one all_reduce sums them over the ranks. Every rank does this once
per group and step, before its own (possibly split and retried) step, so the collectives are
the same on every rank whatever their micro-batches. The losses hold the sums for the step
only (`step_sums` clears them after it, failed or not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from mdtrain import distributed as dist_rt
from mdtrain.batching import Batch
from mdtrain.memory import InferenceChunker


def needs_sums(losses: Sequence) -> bool:
    """Whether any of the losses needs its global batch sums (the same on every rank)."""
    return any(getattr(loss, "needs_batch_sums", False) for loss in losses)


@contextlib.contextmanager
def step_sums(
    losses: Sequence,
    forward: Callable[[tuple], list[dict[str, torch.Tensor]]],
    batch_of: Callable[[np.ndarray], Batch],
    frames: np.ndarray,
    natoms: int,
    name: str,
    chunker: InferenceChunker,
) -> Iterator[None]:
    """Give each loss that needs them its global ``(S, G)`` for the step inside the block.
    ``forward(inputs)``: the predictions of the losses' models, in order; ``batch_of``: a
    batch of some of ``frames`` (``natoms`` atoms each, system ``name``)."""
    if not needs_sums(losses):
        yield
        return

    def part(start: int, stop: int) -> torch.Tensor:
        batch = batch_of(frames[start:stop])
        with torch.no_grad():
            preds = forward(batch.inputs())
        rows = [
            loss.batch_sums(pred, batch.labels, batch.natoms)
            if getattr(loss, "needs_batch_sums", False)
            else batch.coord.new_zeros(2, dtype=torch.float64)
            for loss, pred in zip(losses, preds, strict=True)
        ]
        return torch.stack(rows)

    sums = dist_rt.all_reduce_sum(sum(chunker.run_all(part, len(frames), natoms, name)))
    try:
        for loss, row in zip(losses, sums):
            if getattr(loss, "needs_batch_sums", False):
                loss.set_batch_sums(row)
        yield
    finally:
        for loss in losses:
            if getattr(loss, "needs_batch_sums", False):
                loss.set_batch_sums(None)
