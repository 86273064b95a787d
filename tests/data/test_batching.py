"""make_batch with a NeighborListCache gives the same batches as without one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.batching import NeighborListCache, make_batch
from mdtrain.data import open_system


def assert_same_batch(a, b) -> None:
    for name in ("coord", "atype", "box", "nlist", "shift"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.labels.keys() == b.labels.keys()
    for key in a.labels:
        assert torch.equal(a.labels[key], b.labels[key])


@pytest.mark.parametrize("fixture", ["water_system", "water_triclinic", "water_nopbc"])
def test_cached_batches_equal_fresh_ones(fixture, request):
    system = open_system(request.getfixturevalue(fixture), ["O", "H"])
    cache = NeighborListCache()
    for indices in ([0, 1], [1, 2], [2, 0], [1, 2]):
        fresh = make_batch(system, indices, 4.0, [10, 20])
        cached = make_batch(system, indices, 4.0, [10, 20], cache=cache)
        assert_same_batch(cached, fresh)
    assert len(cache) == 3 and cache.misses == 3 and cache.hits == 5
    # another cutoff or sel is another list
    other = make_batch(system, [0], 3.0, [10, 20], cache=cache)
    assert_same_batch(other, make_batch(system, [0], 3.0, [10, 20]))
    assert len(cache) == 4 and cache.misses == 4
    assert cache.nbytes == sum(a.nbytes + b.nbytes for a, b in cache._lists.values())
    assert all(a.dtype == np.int32 and b.dtype == np.int8 for a, b in cache._lists.values())


def test_full_cache_keeps_nothing_more_and_stays_exact(water_system):
    system = open_system(water_system, ["O", "H"])
    first = make_batch(system, [0], 4.0, [10, 20], cache=NeighborListCache())
    one_frame = NeighborListCache().nbytes + first.nlist.numel() * (4 + 3)
    cache = NeighborListCache(max_bytes=one_frame)
    for indices in ([0], [1], [0], [1]):
        batch = make_batch(system, indices, 4.0, [10, 20], cache=cache)
        assert_same_batch(batch, make_batch(system, indices, 4.0, [10, 20]))
    assert len(cache) == 1 and cache.nbytes == one_frame
    assert cache.hits == 1 and cache.misses == 3
