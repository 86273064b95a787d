"""Walk the input against the JSON Schema: drop ``_`` keys, resolve aliases, fill defaults.

Everything about keys, types, ranges and defaults comes from the schema
(``input_schemas/input.schema.json``); this module only walks it, so that adding a key or an
alias is a schema edit. Problems met on the way (a key given twice, an unsupported DeePMD
option) are appended to a list, worded by ``wording``.
"""

from __future__ import annotations

import copy
from typing import Any

from mdtrain.config.wording import join, show
from mdtrain.schema import matching_branches, property_aliases, resolve, schema_types


def strip_private(value: Any) -> Any:
    """A deep copy without keys that begin with ``_`` (comments), at every level."""
    if isinstance(value, dict):
        return {
            k: strip_private(v)
            for k, v in value.items()
            if not (isinstance(k, str) and k.startswith("_"))
        }
    if isinstance(value, list):
        return [strip_private(v) for v in value]
    return value


def apply_aliases(value: Any, node: dict, path: tuple, problems: list[str]) -> Any:
    """Rename alias keys and alias values to their canonical names, following the schema.

    Keys listed in an object's ``x-off-defaults`` (DeePMD options this trainer lacks) are
    dropped when they hold their "off" value, and reported otherwise; keys in ``x-ignored``
    are dropped whatever their value.
    """
    node = resolve(node)
    if isinstance(value, dict) and "properties" in node:
        aliases = property_aliases(node)
        off = node.get("x-off-defaults", {})
        renamed: dict = {}
        for key, item in value.items():
            name = aliases.get(key, key)
            if name in renamed or (name != key and name in value):
                problems.append(f"{join(path, name)}: given twice (also as {key!r})")
                continue
            if name in node.get("x-ignored", {}) and name not in node["properties"]:
                continue
            if name in off and name not in node["properties"]:
                if not _same_json(item, off[name]):
                    problems.append(
                        f"{join(path, name)}: not supported by mdtrain; remove it or set it "
                        f"to {show(off[name])}, got {show(item)}"
                    )
                continue
            renamed[name] = item
        props = node["properties"]
        return {
            k: apply_aliases(v, props[k], (*path, k), problems) if k in props else v
            for k, v in renamed.items()
        }
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [apply_aliases(v, node["items"], (*path, i), problems) for i, v in enumerate(value)]
    branches = matching_branches(value, node)
    if len(branches) == 1:
        return apply_aliases(value, branches[0], path, problems)
    if isinstance(value, str):
        return node.get("x-value-aliases", {}).get(value, value)
    return value


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality: ``false`` is not ``0`` (Python says it is), ``1`` is ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def fill_defaults(value: Any, node: dict) -> Any:
    """Add missing keys that have a schema default, in schema order; give numbers their type.

    An integral float where the schema wants an integer becomes an int (``1e5`` steps), an int
    where it wants a number becomes a float.

    Values of the wrong type are left alone: the validator reports them.
    """
    node = resolve(node)
    if isinstance(value, dict) and "properties" in node:
        filled: dict = {}
        for name, sub in node["properties"].items():
            if name in value:
                filled[name] = fill_defaults(value[name], sub)
            elif "default" in (sub_node := resolve(sub)):
                filled[name] = fill_defaults(copy.deepcopy(sub_node["default"]), sub)
        filled.update((k, v) for k, v in value.items() if k not in filled)
        return filled
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [fill_defaults(v, node["items"]) for v in value]
    branches = matching_branches(value, node)
    if len(branches) == 1:
        return fill_defaults(value, branches[0])
    types = schema_types(node)
    if (
        isinstance(value, float)
        and value.is_integer()
        and "integer" in types
        and "number" not in types
    ):
        return int(value)
    if type(value) is int and "number" in types and "integer" not in types:
        return float(value)
    return value
