"""The entry points: read and parse input.json, complete and check it, report every problem.

``complete_config`` is the pipeline: drop ``_`` keys, resolve aliases and fill defaults
(``schema_walk``), validate against the schema (messages from ``wording``), then the checks
that relate several fields (``checks``). Problems are collected, never raised one at a time,
so one run of ``mdtrain check`` lists them all. Also the two file helpers callers use with a
config: ``resolve_path`` and ``dump_config``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from mdtrain.config.checks import cross_checks
from mdtrain.config.model_kind import table_sections
from mdtrain.config.precision import apply_output_prec
from mdtrain.config.quick_check import surely_valid
from mdtrain.config.schema_walk import apply_aliases, fill_defaults, strip_private
from mdtrain.config.type_map import fill_type_map
from mdtrain.config.wording import describe, format_problems, show
from mdtrain.errors import MDTrainError
from mdtrain.schema import load_schema

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator

log = logging.getLogger("mdtrain.config")


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
    config = normalize_config(parse_json(text, source), source)
    for _, key, section in table_sections(config.get("model")):
        if isinstance(section.get(key), str):  # table files, as systems are
            section[key] = resolve_path(source, section[key])
    return config


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
        return {}, [f"(top level): expected an object, got {show(data)}"]
    schema = load_schema()
    problems: list[str] = []
    config = strip_private(data)
    config = apply_aliases(config, schema, (), problems)
    config = fill_defaults(config, schema)
    config = fill_type_map(config, problems)
    problems.extend(apply_output_prec(config))  # DeePMD-kit's networks' precision
    if not surely_valid(config, schema):  # jsonschema (0.1 s to import) words the problems
        for error in _validator().iter_errors(config):
            problems.extend(describe(error))
    problems.extend(cross_checks(config))
    return config, list(dict.fromkeys(problems))


@functools.cache
def _validator() -> Draft202012Validator:
    from jsonschema import Draft202012Validator

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
