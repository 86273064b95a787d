"""Gathers whose gradients add up in a fixed order.

Advanced indexing (``table[index]``) has ``index_put_`` with accumulate as its backward, which
on CPU adds float32 with atomics when more than one thread runs and the gradient is large
(32768 elements and more): two runs of the same training step then differ in the last bits.
``index_select``'s backward (``index_add_``) adds in index order.
"""

from __future__ import annotations

from torch import Tensor


def take(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` over the first dimension, as one ``index_select``."""
    picked = table.index_select(0, index.reshape(-1))
    return picked.view(index.shape + table.shape[1:])


def take_pairs(table: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """``table[first, second]`` (indices broadcast) over the first two dimensions."""
    return take(table.flatten(0, 1), first * table.shape[1] + second)
