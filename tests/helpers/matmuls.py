"""Which dtypes the matrix products of a block ran in (the mixed-precision tests)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matrix product dispatched (after autocast casts)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
            self.seen[(name, *sorted(str(d) for d in dtypes))] += 1
        return func(*args, **(kwargs or {}))
