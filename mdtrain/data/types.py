"""A system's atom types: ``type.raw`` checked, remapped to the model's ``type_map`` by element
name and sorted (stable, DeePMD's rule), so that every array a `System` hands out is in that
order.

As Python lists: a system holds a few dozen atoms, which cost less in Python than numpy's
calls, and a start-up opens thousands of systems.
"""

from __future__ import annotations

import numpy as np

from mdtrain.errors import MDTrainError


def remap_types(
    path: str, own: list[int], own_map: list[str] | None, model_map: list[str] | None
) -> tuple[list[int], list[str]]:
    """Model types of the atoms (file order) and the names of the system's own types;
    ``own``: ``type.raw``, ``own_map``: ``type_map.raw`` (None when absent)."""
    if min(own) < 0:
        raise MDTrainError(f"system {path}: type.raw holds a negative type")
    ntypes_own = max(own) + 1
    if own_map is not None and len(own_map) < ntypes_own:
        raise MDTrainError(
            f"system {path}: type.raw uses type {ntypes_own - 1} but type_map.raw "
            f"names only {len(own_map)} elements"
        )
    if own_map is None:
        if model_map is not None and ntypes_own > len(model_map):
            raise MDTrainError(
                f"system {path}: type.raw uses type {ntypes_own - 1} but type_map has "
                f"{len(model_map)} elements {model_map} (and there is no type_map.raw)"
            )
        elements = (
            list(model_map[:ntypes_own]) if model_map else [f"type_{t}" for t in range(ntypes_own)]
        )
        return own, elements
    if model_map is None:
        return own, list(own_map)
    index = {name: t for t, name in reversed(list(enumerate(model_map)))}  # first wins
    lookup = [index.get(name, -1) for name in own_map]
    model_types = [lookup[t] for t in own]
    if min(model_types) < 0:
        missing = sorted({own_map[t] for t in own if lookup[t] < 0})
        raise MDTrainError(
            f"system {path}: element {', '.join(missing)} is not in type_map {model_map}"
        )
    return model_types, list(own_map)


def sort_by_type(model_types: list[int]) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(atom_order, atype, reordered)``: the file's atoms in the model's order (stable),
    their types in that order, and whether the order differs from the file's."""
    order = sorted(range(len(model_types)), key=model_types.__getitem__)
    atype = np.array([model_types[i] for i in order], dtype=np.int64)
    return np.array(order, dtype=np.int64), atype, order != list(range(len(order)))
