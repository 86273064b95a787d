"""Which part of a pass over the data each rank takes when ranks split statistics.

The work is a sequence of groups (systems, or statistics batches) of equal items (frames),
each item with a weight (its atoms: the neighbour search and the descriptor cost grow with
them). Rank ``r`` of ``world`` takes the items whose start falls in the ``r``-th of ``world``
equal slices of the total weight, so every rank gets a contiguous run of the sequence, the
shares cover it exactly once, and they depend only on the sizes: every rank computes its own
share without talking to the others.
"""

from __future__ import annotations

from collections.abc import Sequence


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def share_ranges(groups: Sequence[tuple[int, int]], rank: int, world: int) -> list[range]:
    """For each group ``(count, weight of one item)``, the item indices of ``rank``.

    Integer arithmetic only, so every rank draws the same boundaries. A weight below 1 counts
    as 1 (an empty frame still has to be read).
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    sizes = [(max(int(count), 0), max(int(weight), 1)) for count, weight in groups]
    total = sum(count * weight for count, weight in sizes)
    low, high = _ceil_div(rank * total, world), _ceil_div((rank + 1) * total, world)
    ranges, offset = [], 0
    for count, weight in sizes:
        first = min(max(_ceil_div(low - offset, weight), 0), count)
        stop = min(max(_ceil_div(high - offset, weight), 0), count)
        ranges.append(range(first, stop))
        offset += count * weight
    return ranges
