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
    are dropped whatever their value; a key that ``x-variant`` reserves for other types than
    the object's is reported.
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
        kind = variant_of(renamed, node)
        for name in renamed:
            if not applies(node, name, kind):
                allowed = node["x-variant"]["only"][name]
                problems.append(
                    f"{join(path, name)}: only for {node['x-variant']['key']} "
                    f"{' or '.join(show(k) for k in allowed)}, not {show(kind)}"
                )
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


def variant_of(value: dict, node: dict) -> Any:
    """The value of the key that picks an object's variant (``x-variant.key``), or its
    default; None for an object without variants."""
    variant = node.get("x-variant")
    if variant is None:
        return None
    key = variant["key"]
    return value.get(key, resolve(node["properties"][key]).get("default"))


def applies(node: dict, name: str, kind: Any) -> bool:
    """Whether key ``name`` belongs to the variant ``kind`` of the object ``node`` (keys
    ``x-variant.only`` does not list belong to every variant; an unknown kind is left to the
    validator)."""
    only = node.get("x-variant", {}).get("only", {})
    return name not in only or not isinstance(kind, str) or kind in only[name]


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
    where it wants a number becomes a float. In an object with variants (``x-variant``), keys
    of other variants get no default, and ``x-variant.defaults`` replaces the defaults of
    some keys for a variant.

    Values of the wrong type are left alone: the validator reports them.
    """
    node = resolve(node)
    if isinstance(value, dict) and "properties" in node:
        filled: dict = {}
        kind = variant_of(value, node)
        own = node.get("x-variant", {}).get("defaults", {})
        own = own.get(kind, {}) if isinstance(kind, str) else {}
        for name, sub in node["properties"].items():
            if name in value:
                filled[name] = fill_defaults(value[name], sub)
            elif not applies(node, name, kind):
                continue
            elif name in own:
                filled[name] = fill_defaults(copy.deepcopy(own[name]), sub)
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
