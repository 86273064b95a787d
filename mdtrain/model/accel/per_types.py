"""Values that depend only on a system's atom types (the order of its rows by type), kept
across steps: a training step's batches repeat a few systems' types, and rebuilding such a
value costs a dozen small operations of one thread per step."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

V = TypeVar("V")

_KEPT: OrderedDict[tuple, object] = OrderedDict()  # most recently used last
_MOST = 64
_LOCK = threading.Lock()


def kept_per_types(what: str, params: tuple, atype: Tensor, build: Callable[[], V]) -> V:
    """``build()``, kept under ``what``, ``params`` and the values of ``atype``, so that a
    changed or another ``atype`` never meets a stale value. CPU types only (a key read from
    another device would synchronise it); built outside inference mode, so that a value first
    made by an inference call serves a training step. The kept values are never written to."""
    if atype.device.type != "cpu" or atype.requires_grad:
        return build()
    key = (what, *params, atype.dtype, tuple(atype.shape), atype.numpy().tobytes())
    with _LOCK:
        value = _KEPT.get(key)
        if value is not None:
            _KEPT.move_to_end(key)
            return value
    with torch.inference_mode(False):
        value = build()
    with _LOCK:
        _KEPT[key] = value
        while len(_KEPT) > _MOST:
            _KEPT.popitem(last=False)
    return value
