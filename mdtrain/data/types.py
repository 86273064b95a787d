"""A system's atom types: ``type.raw`` checked, remapped to the model's ``type_map`` by element
name and sorted (stable, DeePMD's rule), so that every array a `System` hands out is in that
order.

As Python lists: a system holds a few dozen atoms, which cost less in Python than numpy's
calls, and a start-up opens thousands of systems.
"""

from __future__ import annotations

from typing import NamedTuple

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


class AtomTypes(NamedTuple):
    """A system's types as `System` keeps them: ``type.raw`` (``own``), ``type_map.raw``
    (``own_map``, None when absent), the model's types in the file's order, the names of
    the system's own types, and `sort_by_type`'s order: systems with the same type files
    share them (``own`` is read-only; a `System` copies the others)."""

    own: np.ndarray
    own_map: list[str] | None
    model_types: list[int]
    elements: list[str]
    atom_order: np.ndarray
    atype: np.ndarray
    reordered: bool


# what the type files of systems opened so far gave, by the texts of type.raw, then of
# type_map.raw and the model's type_map: thousands of small systems have a few compositions,
# so their types are parsed, remapped and sorted a few times, not once each
_KNOWN: dict[str, dict[tuple, AtomTypes]] = {}
_MAX_KNOWN = 4096


def read_atom_types(path: str, store, model_map: list[str] | None) -> AtomTypes:
    """The `AtomTypes` of the system ``path`` from its ``store``'s ``type.raw`` and
    ``type_map.raw``, checked (one-line errors naming the system); a store that gives the
    files' texts (``store.text``) has its types worked out once per distinct text."""
    text = getattr(store, "text", None)
    if text is None:  # HDF5, LMDB: no texts to recognise
        return _atom_types(path, store.types(), store.type_map, model_map)
    types_text = text("type.raw")
    if types_text is None:
        return _atom_types(path, None, None, model_map)
    known = _KNOWN.get(types_text)
    map_text: list[str | None] = []

    def own_map() -> list[str] | None:  # read once, after type.raw is checked
        if not map_text:
            map_text.append(text("type_map.raw"))
        return None if map_text[0] is None else map_text[0].split()

    if known is None:
        found = _atom_types(path, store.types(types_text), own_map, model_map)
        if len(_KNOWN) >= _MAX_KNOWN:
            _KNOWN.clear()
        _KNOWN[types_text] = {(map_text[0], _key(model_map)): found}
        return found
    own_map()
    key = (map_text[0], _key(model_map))
    found = known.get(key)
    if found is None:
        found = known[key] = _atom_types(path, next(iter(known.values())).own, own_map,
                                         model_map)  # fmt: skip
    return found


def _key(model_map: list[str] | None) -> tuple[str, ...] | None:
    return None if model_map is None else tuple(model_map)


def _atom_types(
    path: str, own_types: np.ndarray | None, own_map_of, model_map: list[str] | None
) -> AtomTypes:
    """`AtomTypes` from ``type.raw``'s integers; ``own_map_of()`` reads ``type_map.raw``
    (after ``type.raw`` is checked, as its errors come first)."""
    if own_types is None:
        raise MDTrainError(f"system {path}: type.raw is missing")
    if own_types.size == 0:
        raise MDTrainError(f"system {path}: type.raw is empty")
    own = own_types.tolist()
    if min(own) < 0:  # before type_map.raw is read
        raise MDTrainError(f"system {path}: type.raw holds a negative type")
    own_map = own_map_of()
    model_types, elements = remap_types(path, own, own_map, model_map)
    atom_order, atype, reordered = sort_by_type(model_types)
    own_types.flags.writeable = False  # shared by the systems of the same type.raw
    return AtomTypes(own_types, own_map, model_types, elements, atom_order, atype, reordered)
