"""Where mdtrain keeps what it builds once per machine (the compiled kernels), without
importing torch: the test session checks it before any worker imports torch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$MDTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/mdtrain``, else ``~/.cache/mdtrain``."""
    root = os.environ.get("MDTRAIN_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mdtrain"
