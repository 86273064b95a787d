"""Load input.json: parse, drop ``_`` keys, resolve aliases, fill defaults, validate.

Everything about keys, types, ranges and defaults comes from the JSON Schema
(``input_schemas/input.schema.json``); this module only walks it. Checks that relate two
fields (``rcut_smth < rcut``, one ``sel`` entry per element, ...) live in ``_cross_checks``.
Problems are collected, never raised one at a time, so one run of ``mdtrain check`` lists them
all.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from mdtrain.errors import MDTrainError
from mdtrain.schema import (
    json_types,
    load_schema,
    matching_branches,
    property_aliases,
    resolve,
    schema_types,
)

log = logging.getLogger("mdtrain.config")

__all__ = [
    "complete_config",
    "dump_config",
    "format_problems",
    "load_config",
    "normalize_config",
    "parse_json",
    "resolve_path",
    "validate_config",
]


# ---------------------------------------------------------------------------------------------
# public API


def load_config(path: str | os.PathLike) -> dict:
    """Read, validate and complete an input file; raise MDTrainError listing every problem."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise MDTrainError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MDTrainError(f"{source}: cannot read: {exc}") from None
    return normalize_config(parse_json(text, source), source)


def parse_json(text: str, source: str) -> Any:
    """Parse JSON text; a syntax error names the line and column."""
    try:
        return json.loads(text, object_pairs_hook=lambda pairs: _object(pairs, source))
    except json.JSONDecodeError as exc:
        raise MDTrainError(
            f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None


def normalize_config(data: Any, source: str) -> dict:
    """The complete configuration for already-parsed input ``data`` (which is not modified)."""
    config, problems = complete_config(data)
    if problems:
        raise MDTrainError(format_problems(source, problems))
    return config


def validate_config(data: Any) -> list[str]:
    """Every problem of already-parsed input ``data``, one message per problem (empty: valid)."""
    return complete_config(data)[1]


def format_problems(source: str, problems: list[str]) -> str:
    """One line for one problem; otherwise a summary line, then one indented line per problem."""
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return f"{source}: {len(problems)} problems\n" + "\n".join(f"  {p}" for p in problems)


def resolve_path(config_path: str | os.PathLike | None, value: str) -> str:
    """An absolute path for ``value`` taken relative to the input file's directory.

    A ``file.h5#/group`` suffix is kept as it is; ``~`` is expanded. With ``config_path``
    None, relative paths are taken from the working directory.
    """
    file_part, sep, group = value.partition("#")
    file_part = os.path.expanduser(file_part)
    if not os.path.isabs(file_part):
        base = os.path.dirname(os.path.abspath(config_path)) if config_path else os.getcwd()
        file_part = os.path.join(base, file_part)
    return os.path.normpath(file_part) + sep + group


def dump_config(config: dict, path: str | os.PathLike) -> None:
    """Write ``config`` as indented JSON, atomically (a reader never sees half a file)."""
    target = os.fspath(path)
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=4)
        handle.write("\n")
    os.replace(tmp, target)


# ---------------------------------------------------------------------------------------------
# the pipeline


def complete_config(data: Any) -> tuple[dict, list[str]]:
    """The completed config and every problem; the config is usable only without problems.

    ``mdtrain check`` uses the partial result to go on checking the data it names.
    """
    if not isinstance(data, dict):
        return {}, [f"(top level): expected an object, got {_show(data)}"]
    schema = load_schema()
    problems: list[str] = []
    config = _strip_private(data)
    config = _apply_aliases(config, schema, (), problems)
    config = _fill_defaults(config, schema)
    for error in _validator().iter_errors(config):
        problems.extend(_describe(error))
    problems.extend(_cross_checks(config))
    return config, list(dict.fromkeys(problems))


@functools.cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(load_schema())


def _object(pairs: list[tuple[str, Any]], source: str) -> dict:
    """JSON object hook: warn about a repeated key (JSON keeps the last silently)."""
    result: dict = {}
    for key, value in pairs:
        if key in result and not key.startswith("_"):
            log.warning(
                "%s: key %r appears twice in one object; the last value is used", source, key
            )
        result[key] = value
    return result


def _strip_private(value: Any) -> Any:
    """A deep copy without keys that begin with ``_`` (comments), at every level."""
    if isinstance(value, dict):
        return {
            k: _strip_private(v)
            for k, v in value.items()
            if not (isinstance(k, str) and k.startswith("_"))
        }
    if isinstance(value, list):
        return [_strip_private(v) for v in value]
    return value


def _apply_aliases(value: Any, node: dict, path: tuple, problems: list[str]) -> Any:
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
                problems.append(f"{_join(path, name)}: given twice (also as {key!r})")
                continue
            if name in node.get("x-ignored", {}) and name not in node["properties"]:
                continue
            if name in off and name not in node["properties"]:
                if not _same_json(item, off[name]):
                    problems.append(
                        f"{_join(path, name)}: not supported by mdtrain; remove it or set it "
                        f"to {_show(off[name])}, got {_show(item)}"
                    )
                continue
            renamed[name] = item
        props = node["properties"]
        return {
            k: _apply_aliases(v, props[k], (*path, k), problems) if k in props else v
            for k, v in renamed.items()
        }
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_apply_aliases(v, node["items"], (*path, i), problems) for i, v in enumerate(value)]
    branches = matching_branches(value, node)
    if len(branches) == 1:
        return _apply_aliases(value, branches[0], path, problems)
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


def _fill_defaults(value: Any, node: dict) -> Any:
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
                filled[name] = _fill_defaults(value[name], sub)
            elif "default" in (sub_node := resolve(sub)):
                filled[name] = _fill_defaults(copy.deepcopy(sub_node["default"]), sub)
        filled.update((k, v) for k, v in value.items() if k not in filled)
        return filled
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_fill_defaults(v, node["items"]) for v in value]
    branches = matching_branches(value, node)
    if len(branches) == 1:
        return _fill_defaults(value, branches[0])
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


# ---------------------------------------------------------------------------------------------
# messages for schema errors


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


def _describe(error: ValidationError) -> list[str]:
    """Human messages (with JSON path) for one validation error."""
    path = tuple(error.absolute_path)
    where = _join(path)
    node = error.schema if isinstance(error.schema, dict) else {}
    kind, expected, value = error.validator, error.validator_value, error.instance

    if kind == "additionalProperties":
        return [_unknown_key(path, key, node) for key in _extra_keys(value, node)]
    if kind == "required":
        return [f"{_join(path, key)}: missing (required)" for key in expected if key not in value]
    if kind in ("anyOf", "oneOf"):
        return _describe_union(error, where, node)
    if "x-error" in node:
        return [f"{where}: {node['x-error']}, got {_show(value)}"]
    if kind == "type":
        wanted = [expected] if isinstance(expected, str) else expected
        return [
            f"{where}: expected {' or '.join(_TYPE_NAMES[t] for t in wanted)}, got {_show(value)}"
        ]
    if kind in _BOUNDS:
        return [f"{where}: must be {_BOUNDS[kind]} {expected}, got {_show(value)}"]
    if kind == "enum":
        choices = ", ".join(_show(c) for c in expected)
        message = f"{where}: must be one of {choices}; got {_show(value)}"
        strings = [c for c in expected if isinstance(c, str)]
        if isinstance(value, str) and (close := difflib.get_close_matches(value, strings, n=1)):
            message += f"; did you mean {_show(close[0])}?"
        return [message]
    if kind == "const":
        return [f"{where}: must be {_show(expected)}, got {_show(value)}"]
    if kind == "pattern":
        return [
            f"{where}: expected {node.get('x-expected', 'a match of ' + expected)}, got {_show(value)}"
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
    fitting = [i for i, b in enumerate(branches) if _fits_type(error.instance, resolve(b))]
    if len(fitting) == 1:
        inner = [e for e in error.context if e.relative_schema_path[0] == fitting[0]]
        if inner:
            return [m for e in inner for m in _describe(e)]
    expected = node.get("x-expected") or " or ".join(
        _TYPE_NAMES.get(t, t) for b in branches for t in sorted(schema_types(resolve(b)))
    )
    return [f"{where}: expected {expected}, got {_show(error.instance)}"]


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
    elsewhere = _key_index().get(key, [])
    if close:
        hint = f"did you mean {property_aliases(node).get(close[0], close[0])!r}?"
    elif elsewhere:
        hint = f"it belongs in {' or '.join(p or '(top level)' for p in elsewhere)}"
    else:
        hint = f"valid keys: {', '.join(valid)}"
    return f"{_join(path, key)}: unknown key; {hint}"


@functools.cache
def _key_index() -> dict[str, list[str]]:
    """Every property name of the schema -> the dotted paths of the objects that have it."""
    index: dict[str, list[str]] = {}

    def visit(node: dict, path: str) -> None:
        node = resolve(node)
        for name, sub in node.get("properties", {}).items():
            index.setdefault(name, []).append(path)
            visit(sub, f"{path}.{name}" if path else name)

    visit(load_schema(), "")
    return index


def _join(path: Iterable, key: str | None = None) -> str:
    """``("model", "descriptor", "sel", 1)`` -> ``model.descriptor.sel[1]``."""
    text = ""
    for part in (*path, key) if key is not None else path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _show(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# checks that relate several fields (run on the completed config, tolerant of wrong types)


def _get(config: dict, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _cross_checks(config: dict) -> list[str]:
    type_map = _get(config, "model.type_map")
    ntypes = len(type_map) if isinstance(type_map, list) else None
    desc = _get(config, "model.descriptor")
    fit = _get(config, "model.fitting_net")
    return [
        *_check_descriptor(desc if isinstance(desc, dict) else {}, ntypes),
        *_check_fitting(fit if isinstance(fit, dict) else {}),
        *_check_schedule_and_loss(config),
    ]


def _check_descriptor(desc: dict, ntypes: int | None) -> list[str]:
    problems = []
    where = "model.descriptor"
    rcut, rcut_smth = desc.get("rcut"), desc.get("rcut_smth")
    if _number(rcut) and _number(rcut_smth) and 0 < rcut <= rcut_smth:
        problems.append(f"{where}.rcut_smth: must be smaller than rcut ({rcut}), got {rcut_smth}")

    sel = desc.get("sel")
    if isinstance(sel, list) and ntypes is not None and len(sel) != ntypes:
        problems.append(
            f"{where}.sel: needs one entry per element of model.type_map ({ntypes}), got {len(sel)}"
        )
    ratio = re.fullmatch(r"auto:(.+)", sel) if isinstance(sel, str) else None
    if ratio and _float_or_none(ratio.group(1)) == 0:
        problems.append(f"{where}.sel: the ratio of {_show(sel)} must be > 0")

    neuron, axis = desc.get("neuron"), desc.get("axis_neuron")
    last = neuron[-1] if isinstance(neuron, list) and neuron else None
    if isinstance(last, int) and isinstance(axis, int) and 1 <= last < axis:
        problems.append(
            f"{where}.axis_neuron: must not exceed the last neuron width ({last}), got {axis}"
        )

    pairs = desc.get("exclude_types")
    for i, pair in enumerate(pairs if isinstance(pairs, list) and ntypes is not None else []):
        for t in pair if isinstance(pair, list) else []:
            if isinstance(t, int) and not isinstance(t, bool) and t >= ntypes:
                problems.append(
                    f"{where}.exclude_types[{i}]: type {t} is not in model.type_map "
                    f"(types 0..{ntypes - 1})"
                )
    return problems


def _check_fitting(fit: dict) -> list[str]:
    trainable, neuron = fit.get("trainable"), fit.get("neuron")
    if (
        isinstance(trainable, list)
        and isinstance(neuron, list)
        and len(trainable) != len(neuron) + 1
    ):
        return [
            f"model.fitting_net.trainable: needs one entry per layer "
            f"({len(neuron) + 1}: hidden layers and output), got {len(trainable)}"
        ]
    return []


def _check_schedule_and_loss(config: dict) -> list[str]:
    problems = []
    start_lr, stop_lr = (
        _get(config, "learning_rate.start_lr"),
        _get(config, "learning_rate.stop_lr"),
    )
    if _number(start_lr) and _number(stop_lr) and 0 < start_lr < stop_lr:
        problems.append(
            f"learning_rate.stop_lr: must not exceed start_lr ({start_lr}), got {stop_lr}"
        )

    loss = _get(config, "loss")
    prefs = (
        [loss.get(f"{w}_pref_{x}") for w in ("start", "limit") for x in "efv"]
        if isinstance(loss, dict)
        else []
    )
    if prefs and all(_number(p) for p in prefs) and not any(prefs):
        problems.append("loss: every prefactor is 0, so there is nothing to train on")
    return problems


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
