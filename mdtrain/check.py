"""Validation of an input and every system it names, in one pass (for ``mdtrain check``).

Unlike ``mdtrain train``, which stops at the first problem, this lists them all (config keys,
missing or malformed systems, elements outside type_map, NaN/inf values with their frames),
so a dataset can be fixed in one round before a long job is queued.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mdtrain.config import complete_config, parse_json, resolve_path
from mdtrain.config.model_kind import table_sections
from mdtrain.config.precision import network_problem
from mdtrain.data import expand_systems, open_systems, validate_system
from mdtrain.data.labels import output_labels
from mdtrain.data.pair_table import check_table_types, read_table_file, types_of_columns
from mdtrain.data.params import ParamSpec, param_problems
from mdtrain.errors import MDTrainError
from mdtrain.progress import progress
from mdtrain.train.loss_labels import label_problems

_SECTIONS = ("training_data", "validation_data")


@dataclass
class CheckReport:
    """What `check_config` found: the problems, and the systems and frames it could read."""

    problems: list[str] = field(default_factory=list)
    nsystems: int = 0
    nframes: int = 0
    sections: list[str] = field(default_factory=list)  # "training: 2 systems, 80 frames"

    def summary(self) -> str:
        """The closing line: ``FAILED: n problems`` or ``OK: ...`` with the counts."""
        if self.problems:
            return f"FAILED: {_plural(len(self.problems), 'problem')}"
        return (
            f"OK: {_plural(self.nsystems, 'system')}, {_plural(self.nframes, 'frame')} "
            f"({'; '.join(self.sections)})"
        )


def read_input(source: str) -> Any:
    """The parsed JSON of the input file ``source``; a file that cannot be read or parsed
    raises `MDTrainError` with the line to print."""
    try:
        with open(source, encoding="utf-8") as handle:
            return parse_json(handle.read(), source)
    except FileNotFoundError:
        raise MDTrainError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MDTrainError(f"{source}: cannot read: {exc}") from None


def check_config(data: Any, source: str) -> CheckReport:
    """Every problem of the parsed input ``data`` (read from ``source``) and of the systems it
    names, one line each."""
    config, config_problems = complete_config(data)
    problems = [f"{source}: {p}" for p in config_problems]
    problems += _check_paths(config, source)
    precision = _get(config, "training", "mixed_precision")
    model = _get(config, "model")
    if isinstance(model, dict) and (
        p := network_problem(precision, model, "training.mixed_precision")
    ):
        problems.append(f"{source}: {p}")
    type_map = _get(config, "model", "type_map")
    if not (isinstance(type_map, list) and all(isinstance(t, str) for t in type_map)):
        type_map = None
    summary = []
    nsys_total = nframes_total = 0
    for section in _SECTIONS:
        part = _get(config, "training", section)
        if not isinstance(part, dict) or not _is_paths(part.get("systems")):
            continue  # absent, or already reported by the schema
        paths, found = _expand(part["systems"], os.path.dirname(os.path.abspath(source)))
        problems += found
        found, nframes = _inspect(
            paths, type_map, _get(config, "loss"), _param_spec(model), _outputs(model)
        )
        problems += found
        problems += _check_per_system_lists(part, len(paths), f"training.{section}", source)
        nsys_total += len(paths)
        nframes_total += nframes
        label = section.removesuffix("_data")
        summary.append(f"{label}: {_plural(len(paths), 'system')}, {_plural(nframes, 'frame')}")
    return CheckReport(problems, nsys_total, nframes_total, summary)


def check_systems(paths: list[str], type_map: list[str] | None) -> list[str]:
    """Problems of the given (already expanded) systems, one line each naming system and frame."""
    return _inspect(paths, type_map)[0]


def _inspect(
    paths: list[str],
    type_map: list[str] | None,
    loss: Any = None,
    spec: ParamSpec | None = None,
    outputs: dict | None = None,
) -> tuple[list[str], int]:
    """Problems and the total number of frames of the systems that could be opened; with the
    ``loss`` section, also the label files its terms need (`label_problems`); ``outputs``:
    the model's own label files (DOS, property), checked for their widths."""
    problems: list[str] = []
    nframes = 0
    for path in progress(paths, len(paths), "checking systems"):
        try:
            systems = open_systems(path, type_map, outputs)
            for system in systems:
                problems += validate_system(system)
                if isinstance(loss, dict):
                    problems += label_problems(loss, system, outputs)
                if spec is not None:
                    problems += param_problems(system, spec)
        except MDTrainError as exc:
            problems.append(str(exc))
            continue
        except (OSError, ValueError) as exc:  # a damaged file the reader did not anticipate
            problems.append(f"system {path}: cannot be read: {exc}")
            continue
        nframes += sum(system.nframes for system in systems)
    return problems, nframes


def _expand(entries: str | list[str], base_dir: str) -> tuple[list[str], list[str]]:
    """Expand entry by entry, so that one missing entry does not hide the others."""
    paths: list[str] = []
    problems: list[str] = []
    for entry in [entries] if isinstance(entries, str) else entries:
        try:
            paths += [p for p in expand_systems(entry, base_dir) if p not in paths]
        except MDTrainError as exc:
            problems.append(str(exc))
    return paths, problems


def _check_per_system_lists(part: dict, nsystems: int, where: str, source: str) -> list[str]:
    """``batch_size`` and ``sys_probs`` lists need one entry per expanded system."""
    problems = []
    for key in ("batch_size", "sys_probs"):
        value = part.get(key)
        if isinstance(value, list) and nsystems and len(value) != nsystems:
            problems.append(
                f"{source}: {where}.{key}: needs one entry per system ({nsystems} after "
                f"expanding 'systems'), got {len(value)}"
            )
    return problems


def _check_paths(config: dict, source: str) -> list[str]:
    """Files named by the input that must already exist (and, for a pair table, be one)."""
    problems = []
    name = _get(config, "training", "neighbor_stat_file")
    if isinstance(name, str) and not os.path.isfile(resolve_path(source, name)):
        path = resolve_path(source, name)
        problems.append(f"{source}: training.neighbor_stat_file: {path} does not exist")
    stat = _get(config, "training", "stat_file")
    if isinstance(stat, str):
        parent = os.path.dirname(resolve_path(source, stat).partition("#")[0])
        if not os.path.isdir(parent):
            problems.append(f"{source}: training.stat_file: directory {parent} does not exist")
    type_map = _get(config, "model", "type_map")
    for where, key, section in table_sections(_get(config, "model")):
        table = section.get(key)
        if not (isinstance(table, str) and isinstance(type_map, list)):
            continue
        path = resolve_path(source, table)
        try:
            raw = read_table_file(path)
            check_table_types(types_of_columns(raw.shape[1] - 1) or 0, type_map, path)
        except MDTrainError as err:
            problems.append(f"{source}: {where}.{key}: {err}")
    return problems


def _param_spec(model: Any) -> ParamSpec | None:
    """The parameters the model section asks for, None when it is too broken to say."""
    try:
        return ParamSpec.of(model) if isinstance(model, dict) else None
    except (TypeError, ValueError):
        return None


def _outputs(model: Any) -> dict | None:
    """The model's own label files, None when the section is too broken to say (the schema
    and the model checks report why)."""
    try:
        return output_labels(model)
    except MDTrainError:
        return None


def _get(config: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(config, dict):
            return None
        config = config.get(key)
    return config


def _is_paths(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
