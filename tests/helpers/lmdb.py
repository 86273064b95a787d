"""LMDB data sets written in DeePMD-kit 3.2's layout (see `mdtrain.data.lmdb_store`), with
lmdb and msgpack directly: ``__metadata__`` and one msgpack record per frame whose arrays are
``{"type", "shape", "data"}`` maps, as the data set of its ``lmdb_downsample_data`` example."""

from __future__ import annotations

import os

import numpy as np


def encode(array) -> dict:
    array = np.ascontiguousarray(array)
    return {"type": str(array.dtype), "shape": list(array.shape), "data": array.tobytes()}


def write_lmdb(
    path: str | os.PathLike,
    frames: list[dict],
    type_map: list[str] | None,
    fmt: str = "012d",
    metadata: dict | None = None,
) -> str:
    """Write ``frames`` (dicts of ``atom_types``, ``coords``, optional ``cells``,
    ``energies``, ``forces``, ``virials`` and ``find_*`` flags; arrays are encoded, other
    values stored as they are) to a new LMDB at ``path``."""
    import lmdb
    import msgpack

    nlocs = [len(frame["atom_types"]) for frame in frames]
    meta = {"nframes": len(frames), "frame_idx_fmt": fmt, "frame_nlocs": nlocs}
    if type_map is not None:
        meta["type_map"] = list(type_map)
    meta.update(metadata or {})
    env = lmdb.open(str(path), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(b"__metadata__", msgpack.packb(meta, use_bin_type=True))
        for i, frame in enumerate(frames):
            record = {
                k: encode(v) if isinstance(v, (np.ndarray, np.generic)) else v
                for k, v in frame.items()
            }
            txn.put(format(i, fmt).encode(), msgpack.packb(record, use_bin_type=True))
    env.close()
    return str(path)


def frames_of(coords, types, boxes=None, energy=None, force=None, virial=None) -> list[dict]:
    """Per-frame records of arrays laid out as deepmd/npy's (frames first)."""
    frames = []
    for f in range(len(coords)):
        frame = {"atom_types": np.asarray(types, dtype=np.int32), "coords": coords[f]}
        for key, value in (("cells", boxes), ("energies", energy), ("forces", force)):
            if value is not None:
                frame[key] = np.asarray(value[f])
        if virial is not None:
            frame["virials"] = np.asarray(virial[f]).reshape(9)
        frames.append(frame)
    return frames
