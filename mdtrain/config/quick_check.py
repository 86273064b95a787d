"""A quick, conservative answer to "does this config satisfy the schema?", without jsonschema.

Importing jsonschema costs about 0.1 s of CPU, a tenth of a ``neighbor-stat`` run over
thousands of small systems. Most inputs are valid, and a valid input needs no message, so
``loader`` asks ``surely_valid`` first and runs jsonschema (which words every problem) only
when it says no. The answer is never "valid" for an input jsonschema would reject: every
keyword is checked at least as strictly as JSON Schema 2020-12 asks (equality in ``enum``
and ``const`` by type and value, numbers by value; ``uniqueItems`` by Python equality; a
NaN fails a bound), and a keyword this module does not know makes the answer "no". A "no" only means "ask
jsonschema", so being stricter costs time, never a wrong message.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

from mdtrain.schema import json_types

# keywords that never reject an instance (annotations; $defs are reached through $ref only)
_ANNOTATIONS = frozenset(
    {"$schema", "$id", "$comment", "$defs", "title", "description", "default", "examples",
     "deprecated", "readOnly", "writeOnly"}
)  # fmt: skip
_SCALARS = (str, int, float, bool, type(None))


def surely_valid(instance: Any, schema: Any, root: dict | None = None) -> bool:
    """True only if ``instance`` satisfies ``schema`` (local ``$ref`` against ``root``);
    False when it does not, or when this module cannot tell."""
    if schema is True:
        return True
    if not isinstance(schema, dict):
        return False  # the false schema, or something that is not a schema
    root = schema if root is None else root
    for keyword, value in schema.items():
        if keyword in _ANNOTATIONS or keyword.startswith("x-"):
            continue
        check = _CHECKS.get(keyword)
        if check is None or not check(instance, value, schema, root):
            return False
    return True


def _type(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    names = [value] if isinstance(value, str) else value
    return isinstance(names, list) and not json_types(instance).isdisjoint(names)


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON Schema has it (1 and 1.0 alike, true and 1 not), or stricter: other
    values must have the same type; containers are compared item by item."""
    if _number(a) and _number(b):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return isinstance(a, _SCALARS) and a == b


def _enum(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    return isinstance(value, list) and any(_same(instance, v) for v in value)


def _const(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    return _same(instance, value)


def _number(instance: Any) -> bool:
    return isinstance(instance, (int, float)) and not isinstance(instance, bool)


def _bound(test):
    def check(instance: Any, value: Any, schema: dict, root: dict) -> bool:
        if not _number(instance):
            return True  # bounds constrain numbers only
        if not _number(value) or (isinstance(instance, float) and math.isnan(instance)):
            return False
        return test(instance, value)

    return check


def _sized(kind: type, test):
    def check(instance: Any, value: Any, schema: dict, root: dict) -> bool:
        if not isinstance(instance, kind):
            return True
        return isinstance(value, int) and not isinstance(value, bool) and test(instance, value)

    return check


def _pattern(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    return not isinstance(instance, str) or (
        isinstance(value, str) and _compiled(value).search(instance) is not None
    )


@functools.cache
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def _unique(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    if value is False or not isinstance(instance, list):
        return True
    if value is not True:
        return False
    if any(isinstance(v, float) and math.isnan(v) for v in instance):
        return False
    # Python's == takes 1, 1.0 and True as equal: stricter than JSON Schema's uniqueness
    return all(a != b for k, a in enumerate(instance) for b in instance[k + 1 :])


def _properties(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    if not isinstance(instance, dict):
        return True
    if not isinstance(value, dict):
        return False
    return all(surely_valid(instance[k], value[k], root) for k in value if k in instance)


def _additional(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    if not isinstance(instance, dict):
        return True
    if "patternProperties" in schema:
        return False  # not used by the input schema; leave it to jsonschema
    known = schema.get("properties", {})
    return all(surely_valid(v, value, root) for k, v in instance.items() if k not in known)


def _required(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    return not isinstance(instance, dict) or (
        isinstance(value, list) and all(k in instance for k in value)
    )


def _items(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    if not isinstance(instance, list):
        return True
    if "prefixItems" in schema or not isinstance(value, (dict, bool)):
        return False
    return all(surely_valid(v, value, root) for v in instance)


def _any_of(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    return isinstance(value, list) and any(surely_valid(instance, s, root) for s in value)


def _ref(instance: Any, value: Any, schema: dict, root: dict) -> bool:
    if not isinstance(value, str) or not value.startswith("#/"):
        return False
    target: Any = root
    for part in value[2:].split("/"):
        if not isinstance(target, dict) or part not in target:
            return False
        target = target[part]
    return surely_valid(instance, target, root)


_CHECKS = {
    "type": _type,
    "enum": _enum,
    "const": _const,
    "minimum": _bound(lambda x, b: x >= b),
    "maximum": _bound(lambda x, b: x <= b),
    "exclusiveMinimum": _bound(lambda x, b: x > b),
    "exclusiveMaximum": _bound(lambda x, b: x < b),
    "minLength": _sized(str, lambda s, n: len(s) >= n),
    "maxLength": _sized(str, lambda s, n: len(s) <= n),
    "minItems": _sized(list, lambda s, n: len(s) >= n),
    "maxItems": _sized(list, lambda s, n: len(s) <= n),
    "pattern": _pattern,
    "uniqueItems": _unique,
    "properties": _properties,
    "additionalProperties": _additional,
    "required": _required,
    "items": _items,
    "anyOf": _any_of,
    "$ref": _ref,
}
