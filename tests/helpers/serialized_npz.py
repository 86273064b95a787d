"""DeePMD-kit's serialised model dicts in one ``.npz`` file, and back (numpy and json only, so
that DeePMD-kit's own environment reads and writes them too: the fixture generator and the
interop driver import this module).

Arrays are replaced by ``{"@array": [offset, shape, dtype]}`` into one flat float64 vector
(one zip entry per model keeps the committed fixture small); float32 arrays survive
exactly, as float64 holds every float32.
"""

from __future__ import annotations

import json

import numpy as np


def pack(obj, arrays: list[np.ndarray]):
    """``obj`` with its arrays replaced by placeholders into the concatenation of ``arrays``."""
    if isinstance(obj, dict):
        return {k: pack(v, arrays) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [pack(v, arrays) for v in obj]
    if isinstance(obj, np.ndarray):
        offset = sum(a.size for a in arrays)
        arrays.append(obj.astype(np.float64).ravel())
        return {"@array": [offset, list(obj.shape), obj.dtype.name]}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def unpack(obj, flat: np.ndarray):
    """The inverse of `pack`."""
    if isinstance(obj, dict) and set(obj) == {"@array"}:
        offset, shape, dtype = obj["@array"]
        size = int(np.prod(shape))
        return flat[offset : offset + size].reshape(shape).astype(dtype)
    if isinstance(obj, dict):
        return {k: unpack(v, flat) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack(v, flat) for v in obj]
    return obj


def entries(name: str, model: dict) -> dict[str, np.ndarray]:
    """The two npz entries ``<name>/model`` (JSON) and ``<name>/arrays`` of one model."""
    arrays: list[np.ndarray] = []
    skeleton = pack(model, arrays)
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    return {f"{name}/model": np.array(json.dumps(skeleton)), f"{name}/arrays": flat}


def read(data, name: str) -> dict:
    """Model ``name`` from a loaded npz (or a dict of its entries)."""
    return unpack(json.loads(str(data[f"{name}/model"])), data[f"{name}/arrays"])
