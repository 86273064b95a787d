"""How a problem is worded: jsonschema ValidationErrors as one line naming the JSON path, the
closest valid key for an unknown one, and values shown short.

Kept apart from the schema walk and the cross-field checks so that every message of
``mdtrain check`` is phrased in one place; this module imports nothing else of the package.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mdtrain.schema import (
    discriminator_values,
    json_types,
    load_schema,
    matching_branches,
    property_aliases,
    resolve,
    schema_types,
)

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError

_TYPE_NAMES = {
    "object": "an object",
    "array": "a list",
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "null": "null",
}

_BOUNDS = {
    "minimum": ">=",
    "exclusiveMinimum": ">",
    "maximum": "<=",
    "exclusiveMaximum": "<",
}


def format_problems(source: str, problems: list[str]) -> str:
    """One line for one problem; otherwise a summary line, then one indented line per problem."""
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return f"{source}: {len(problems)} problems\n" + "\n".join(f"  {p}" for p in problems)


def describe(error: ValidationError) -> list[str]:
    """Human messages (with JSON path) for one validation error."""
    path = tuple(error.absolute_path)
    where = join(path)
    node = error.schema if isinstance(error.schema, dict) else {}
    kind, expected, value = error.validator, error.validator_value, error.instance

    if kind == "additionalProperties":
        return [_unknown_key(path, key, node) for key in _extra_keys(value, node)]
    if kind == "required":
        return [f"{join(path, key)}: missing (required)" for key in expected if key not in value]
    if kind in ("anyOf", "oneOf"):
        return _describe_union(error, where, node)
    if "x-error" in node:
        return [f"{where}: {node['x-error']}, got {show(value)}"]
    if kind == "type":
        wanted = [expected] if isinstance(expected, str) else expected
        return [
            f"{where}: expected {' or '.join(_TYPE_NAMES[t] for t in wanted)}, got {show(value)}"
        ]
    if kind in _BOUNDS:
        return [f"{where}: must be {_BOUNDS[kind]} {expected}, got {show(value)}"]
    if kind == "enum":
        choices = ", ".join(show(c) for c in expected)
        message = f"{where}: must be one of {choices}; got {show(value)}"
        strings = [c for c in expected if isinstance(c, str)]
        if isinstance(value, str) and (close := difflib.get_close_matches(value, strings, n=1)):
            message += f"; did you mean {show(close[0])}?"
        return [message]
    if kind == "const":
        return [f"{where}: must be {show(expected)}, got {show(value)}"]
    if kind == "pattern":
        return [
            f"{where}: expected {node.get('x-expected', 'a match of ' + expected)}, got {show(value)}"
        ]
    if kind == "minItems":
        return [f"{where}: needs at least {_entries(expected)}, got {len(value)}"]
    if kind == "maxItems":
        return [f"{where}: allows at most {_entries(expected)}, got {len(value)}"]
    if kind == "minLength":
        return [f"{where}: must not be empty"]
    if kind == "uniqueItems":
        repeated = sorted({json.dumps(v) for v in value if value.count(v) > 1})
        return [f"{where}: entries must be unique; repeated: {', '.join(repeated)}"]
    return [f"{where}: {error.message}"]


def _describe_union(error: ValidationError, where: str, node: dict) -> list[str]:
    """For anyOf: when one branch has the value's type, its own errors are the useful ones."""
    branches = node.get(error.validator, [])
    key, value = node.get("x-discriminator"), error.instance
    if key and isinstance(value, dict):
        if key not in value:
            return [f"{join(error.absolute_path, key)}: missing (required)"]
        if not matching_branches(value, node):
            names = []
            for branch in branches:
                accepted = discriminator_values(resolve(branch), key)
                alias = f" (alias {', '.join(accepted[1:])})" if accepted[1:] else ""
                names.append(f"{accepted[0]}{alias}")
            return [
                f"{join(error.absolute_path, key)}: {show(value[key])} is not supported; "
                f"supported: {', '.join(names)}"
            ]
        picked = [resolve(b) for b in branches]
        fitting = [i for i, b in enumerate(picked) if b in matching_branches(value, node)]
    else:
        fitting = [i for i, b in enumerate(branches) if _fits_type(value, resolve(b))]
    if len(fitting) == 1:
        inner = [e for e in error.context if e.relative_schema_path[0] == fitting[0]]
        if inner:
            return [m for e in inner for m in describe(e)]
    expected = node.get("x-expected") or " or ".join(
        _TYPE_NAMES.get(t, t) for b in branches for t in sorted(schema_types(resolve(b)))
    )
    return [f"{where}: expected {expected}, got {show(error.instance)}"]


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _fits_type(value: Any, node: dict) -> bool:
    declared = schema_types(node)
    return not declared or bool(declared & json_types(value))


def _extra_keys(value: dict, node: dict) -> list[str]:
    return [k for k in value if k not in node.get("properties", {})]


def _unknown_key(path: tuple, key: str, node: dict) -> str:
    valid = list(node.get("properties", {}))
    candidates = valid + list(property_aliases(node))
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    # another variant of this very object may have it (a pairtab model's rcut): not a hint
    elsewhere = [p for p in _key_index().get(key, []) if p != join(path)]
    if close:
        hint = f"did you mean {property_aliases(node).get(close[0], close[0])!r}?"
    elif elsewhere:
        hint = f"it belongs in {' or '.join(p or '(top level)' for p in elsewhere)}"
    else:
        hint = f"valid keys: {', '.join(valid)}"
    return f"{join(path, key)}: unknown key; {hint}"


@functools.cache
def _key_index() -> dict[str, list[str]]:
    """Every property name of the schema -> the dotted paths of the objects that have it."""
    index: dict[str, list[str]] = {}

    def visit(node: dict, path: str) -> None:
        node = resolve(node)
        for name, sub in node.get("properties", {}).items():
            if path not in index.setdefault(name, []):
                index[name].append(path)
            visit(sub, f"{path}.{name}" if path else name)
        for branch in node.get("anyOf", []) if node.get("x-discriminator") else []:
            visit(branch, path)

    visit(load_schema(), "")
    return index


def join(path: Iterable, key: str | None = None) -> str:
    """``("model", "descriptor", "sel", 1)`` -> ``model.descriptor.sel[1]``."""
    text = ""
    for part in (*path, key) if key is not None else path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def show(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
