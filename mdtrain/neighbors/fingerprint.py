"""What identifies a data set: a content hash per system and one fingerprint over all of them.

Independent of paths and of the order of systems, so that a neighbour-stat file still matches
data that only moved. Used by the statistics (``stat``) and by the file check (``stat_file``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any


def content_hash(fingerprint: dict[str, Any]) -> str:
    """The content hash from ``System.fingerprint()``: the one hex-digest value other than path.

    Taken by name when present (``sha256``/``hash``), so that a moved data set still matches.
    """
    for key in ("sha256", "hash", "content_hash", "digest"):
        if isinstance(fingerprint.get(key), str):
            return fingerprint[key]
    rest = {k: v for k, v in fingerprint.items() if k != "path"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, default=str).encode()).hexdigest()


def data_fingerprint(system_hashes: Sequence[str]) -> str:
    """sha256 over the sorted content hashes of the systems: independent of paths and order."""
    return hashlib.sha256("\n".join(sorted(system_hashes)).encode()).hexdigest()
