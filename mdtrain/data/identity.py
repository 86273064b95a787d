"""A system's content hash, for the neighbour-statistics file: its atom types, coordinates and
cells hashed (SHA-256) as little-endian integers and float64, so that the same data in
deepmd/npy and deepmd/hdf5 hash the same."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

HASH_BYTES = 4 << 20  # frames are hashed this many bytes (as float64) at a time


def content_digest(
    own_types: np.ndarray,
    own_map: list[str] | None,
    periodic: bool,
    sets: Sequence,
    width: Callable[[str], int],
    store,
) -> str:
    """The hex digest of ``type.raw`` (``own_types``), ``type_map.raw`` and the coordinates
    (and cells) of ``sets`` (`SetInfo`), ``width(name)`` values per frame, read from
    ``store`` a few megabytes at a time (a whole HDF5 set would be read into memory); an
    array the store keeps whole (``store.kept``: thousands of small systems) at once."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(own_types, dtype="<i8").tobytes())
    if own_map is not None:
        digest.update(" ".join(own_map).encode())
    digest.update(b"pbc" if periodic else b"nopbc")
    kept = getattr(store, "kept", None)
    for set_info in sets:
        for name in ("coord", "box") if periodic else ("coord",):
            step = max(1, HASH_BYTES // (8 * width(name)))
            whole = None if kept is None or set_info.nframes > step else kept(set_info.name, name)
            if whole is not None:  # the same bytes as its rows read in one step
                digest.update(np.ascontiguousarray(whole, dtype="<f8").data)
                continue
            for start in range(0, set_info.nframes, step):
                rows = np.arange(start, min(start + step, set_info.nframes))
                data = store.rows(set_info.name, name, rows)
                digest.update(np.ascontiguousarray(data, dtype="<f8").data)
    return digest.hexdigest()
