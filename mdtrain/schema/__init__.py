"""The input JSON Schema and the few helpers needed to walk it.

The schema (``input_schemas/input.schema.json``, shipped here as package data) is the single
source of truth for keys, types, defaults and descriptions. Besides standard JSON Schema it
uses a few ``x-`` keywords that validators ignore:

- ``x-aliases``: other names accepted for a property (renamed before validation);
- ``x-value-aliases``: other values accepted for a string (``{"se_a": "se_e2_a"}``);
- ``x-expected``: how to describe the accepted values in an error message;
- ``x-error``: the message shown when the value is rejected;
- ``x-off-defaults``: DeePMD keys of an object that mdtrain does not implement, with their
  "off" value: accepted (and dropped) only at that value;
- ``x-ignored``: DeePMD keys of an object that are accepted and dropped whatever their value;
- ``x-discriminator``: on an object with ``anyOf`` branches (the descriptor, the fitting
  net, the loss), the key whose value picks the branch (the branch whose property of that
  name lists it in its ``enum`` or its ``x-value-aliases``; when the key is left out, the one
  branch whose property has a ``default``);
- ``x-plain-title``: on a branch of such a union, document it under the union's own path
  (the standard model is ``model``, not ``model (type standard)``);
- ``x-variant``: an object whose keys depend on one of them (``key``, e.g. ``type``):
  ``only`` lists the variants each restricted key belongs to, ``defaults`` the defaults
  that differ by variant (``{variant: {key: default}}``).
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

SCHEMA_FILE = "input.schema.json"


@functools.cache
def load_schema() -> dict:
    """The parsed input schema (cached; treat it as read-only)."""
    text = (resources.files("mdtrain") / "schema" / SCHEMA_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def resolve(node: dict, root: dict | None = None) -> dict:
    """Follow a local ``$ref`` and merge the referring node's own keywords over the target."""
    root = load_schema() if root is None else root
    while "$ref" in node:
        ref = node["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"only local $ref are supported, got {ref!r}")
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def json_types(value: Any) -> set[str]:
    """JSON Schema type names that ``value`` satisfies (an integral float is also an integer)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"integer", "number"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    if isinstance(value, dict):
        return {"object"}
    return set()


def schema_types(node: dict) -> set[str]:
    """Type names a (resolved) schema node declares; empty when it declares none."""
    declared = node.get("type", [])
    return {declared} if isinstance(declared, str) else set(declared)


def matching_branches(value: Any, node: dict, root: dict | None = None) -> list[dict]:
    """The resolved ``anyOf``/``oneOf`` branches whose declared type fits ``value`` (and,
    under an ``x-discriminator``, whose discriminating key accepts the value's)."""
    branches = node.get("anyOf", []) + node.get("oneOf", [])
    key = node.get("x-discriminator")
    found = []
    for branch in branches:
        branch = resolve(branch, root)
        declared = schema_types(branch)
        if declared and not declared & json_types(value):
            continue
        picked = not (key and isinstance(value, dict) and key in value)
        if picked or value[key] in discriminator_values(branch, key, root):
            found.append(branch)
    if key and isinstance(value, dict) and key not in value and len(found) > 1:
        # the discriminating key left out: the branch whose key has a default (``ener``)
        default = [b for b in found if "default" in resolve(b["properties"][key], root)]
        if len(default) == 1:
            return default
    return found


def discriminator_values(branch: dict, key: str, root: dict | None = None) -> list[Any]:
    """The values of ``key`` a branch accepts: its ``enum``, then its value aliases."""
    prop = resolve(branch.get("properties", {}).get(key, {}), root)
    return list(prop.get("enum", [])) + list(prop.get("x-value-aliases", {}))


def property_aliases(node: dict, root: dict | None = None) -> dict[str, str]:
    """``{alias: canonical name}`` for the properties of a resolved object schema."""
    aliases = {}
    for name, sub in node.get("properties", {}).items():
        for alias in resolve(sub, root).get("x-aliases", []):
            aliases[alias] = name
    return aliases
