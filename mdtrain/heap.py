"""The process's heap: freed memory kept for reuse (glibc), without importing torch, so that
``neighbor-stat``, which never imports torch, keeps its freed arrays too."""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_allocator_tuned: bool | None = None


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of returning it to the OS (once per
    process, called by the commands that evaluate the model repeatedly, not by library users;
    ``MDTRAIN_KEEP_FREED_MEMORY=0`` turns it off).

    A training step allocates and frees the same multi-megabyte tensors every time. By
    default glibc serves such blocks with fresh ``mmap`` pages and unmaps them on free, so
    every step pays page faults on them again: on a virtual machine that cost up to half the
    step time. Keeping the blocks in the heap makes the process hold its peak memory, which
    it needs at every step anyway. ``neighbor-stat``'s passes over thousands of small cells
    allocate and free arrays of a few megabytes the same way (about 22,000 page faults, 0.1 s
    of its CPU, without the setting). Returns whether the setting is in effect.
    """
    global _allocator_tuned
    if _allocator_tuned is None:
        _allocator_tuned = False
        if sys.platform.startswith("linux") and os.environ.get(
            "MDTRAIN_KEEP_FREED_MEMORY", "1"
        ).strip() not in ("0", "false", "no"):
            try:
                mallopt = ctypes.CDLL(None).mallopt
                mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                mallopt.restype = ctypes.c_int
                _allocator_tuned = (
                    mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
                )
            except (OSError, AttributeError):
                pass
    return _allocator_tuned
