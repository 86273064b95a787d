"""``mdtrain neighbor-stat``: neighbour statistics as a stage of its own (computed and written
by `mdtrain.neighbors`).

Two forms:

- ``mdtrain neighbor-stat input.json [-o FILE]``: training and validation systems, rcut and
  type_map from the input (system paths relative to the input's directory);
- ``mdtrain neighbor-stat -s SYSTEM... -r RCUT -t TYPE... [-o FILE]``.

Writes the JSON file that ``mdtrain train --neighbor-stat-file`` reads, and prints a short
table. Imports neither torch nor the config schema machinery in the second form, so that
it starts fast. Reads coordinates and cells only: the label files (energies, forces, ...)
are neither read nor checked here (``mdtrain check`` and ``train`` do), a third of the
files of thousands of small systems.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
from typing import Any

from mdtrain.errors import MDTrainError
from mdtrain.heap import keep_freed_memory
from mdtrain.neighbors.sel import DEFAULT_SEL_RATIO, parse_sel, resolve_sel
from mdtrain.neighbors.stat import compute_neighbor_stat
from mdtrain.neighbors.stat_file import write_neighbor_stat
from mdtrain.neighbors.stat_result import NeighborStat
from mdtrain.outputs import KIND_NEIGHBOR_STAT, Output, check_outputs

log = logging.getLogger("mdtrain.neighbors")


def run_neighbor_stat(args: argparse.Namespace) -> int:
    """Entry point of the subcommand; returns the exit code."""
    from mdtrain.data import expand_systems, open_all

    inputs = [("input", args.input)] if args.input else [("-s", s) for s in args.system or []]
    output = Output("-o", args.output, KIND_NEIGHBOR_STAT, create=True)
    check_outputs([output], inputs)  # before any system is read
    sel_ratio = getattr(args, "sel_ratio", None)
    input_sel, mixed = None, False
    if args.input:
        if args.system or args.rcut is not None or args.type_map:
            raise MDTrainError(
                "neighbor-stat: give either input.json or -s/-r/-t, not both "
                "(rcut, type_map and systems come from the input file)"
            )
        entries, base_dir, rcut, type_map, input_sel, mixed = _from_input(args.input)
        if sel_ratio is None and input_sel is not None:
            parsed = parse_sel(input_sel)
            sel_ratio = parsed if isinstance(parsed, float) else None
    else:
        missing = [
            flag
            for flag, value in (("-s/--system", args.system), ("-r/--rcut", args.rcut),
                                ("-t/--type-map", args.type_map))
            if not value and value != 0
        ]  # fmt: skip
        if missing:
            raise MDTrainError(
                f"neighbor-stat: missing {', '.join(missing)} (or give an input.json instead); "
                "usage: mdtrain neighbor-stat -s SYSTEM... -r RCUT -t TYPE..."
            )
        entries, base_dir, rcut, type_map = list(args.system), os.getcwd(), args.rcut, args.type_map
    sel_ratio = DEFAULT_SEL_RATIO if sel_ratio is None else float(sel_ratio)
    if not (math.isfinite(sel_ratio) and sel_ratio > 0):
        raise MDTrainError(f"neighbor-stat: --sel-ratio must be positive, got {sel_ratio}")
    rcut = float(rcut)
    if not (math.isfinite(rcut) and rcut > 0):
        raise MDTrainError(f"neighbor-stat: rcut must be a positive number of Å, got {rcut}")
    type_map = list(type_map)
    if len(set(type_map)) != len(type_map):
        raise MDTrainError(f"neighbor-stat: type_map {type_map} names an element twice")

    # thousands of systems make a few hundred thousand objects and no cycles worth
    # collecting: the collector's passes over them cost 3-4 % of the command
    collecting = gc.isenabled()
    gc.disable()
    keep_freed_memory()  # the passes' arrays reused, not faulted in again
    try:
        listings: dict = {}  # each system folder listed once, when it is found
        paths = expand_systems(entries, base_dir, listings)
        systems = open_all(paths, type_map, positions_only=True, listings=listings)
        stat = compute_neighbor_stat(systems, rcut, len(type_map))
        content = write_neighbor_stat(args.output, stat, type_map, sel_ratio)
    finally:
        if collecting:
            gc.enable()
    if input_sel is not None and not isinstance(parse_sel(input_sel), float):
        sizes = [stat.max_nbor_total] if mixed else stat.max_nbor_size
        resolve_sel(input_sel, sizes, mixed)  # warns when the input's sel is too small
    print(format_table(stat, type_map, content, args.output, input_sel, mixed))
    return 0


def _from_input(path: str) -> tuple[list[str], str, float, list[str], Any, bool]:
    """Systems, base directory, rcut, type_map and sel of an input file, and whether its
    descriptor takes one type-mixed neighbour list."""
    from mdtrain.config import load_config, mixed_types

    if not os.path.isfile(path):
        raise MDTrainError(f"{path}: input file not found")
    config = load_config(path)
    model = config.get("model", {})
    descriptor = model.get("descriptor", {})
    rcut, sel = descriptor.get("rcut"), descriptor.get("sel")
    members = descriptor.get("list") if descriptor.get("type") == "hybrid" else None
    if isinstance(members, list) and members:  # a hybrid's list reaches its largest rcut
        cuts = [m.get("rcut") for m in members if isinstance(m, dict)]
        rcut = max(cuts) if cuts and None not in cuts else None
    type_map = model.get("type_map")
    if rcut is None:
        raise MDTrainError(f"{path}: model.descriptor.rcut is required for neighbor-stat")
    if not type_map:
        raise MDTrainError(f"{path}: model.type_map is required for neighbor-stat")
    training = config.get("training", {})
    entries: list[str] = []
    for key in ("training_data", "validation_data"):
        section = training.get(key) or {}
        systems = section.get("systems")
        if systems:
            entries.extend([systems] if isinstance(systems, str) else list(systems))
    if not entries:
        raise MDTrainError(f"{path}: training.training_data.systems is empty")
    base_dir = os.path.dirname(os.path.abspath(path))
    return entries, base_dir, float(rcut), list(type_map), sel, mixed_types(descriptor)


def format_table(
    stat: NeighborStat,
    type_map: list[str],
    content: dict[str, Any],
    output: str,
    input_sel: Any = None,
    mixed: bool = False,
) -> str:
    """The short summary printed to stdout: a row per type and one for all types together
    (what the one ``sel`` of a mixed-types descriptor must hold; ``mixed``: the input's)."""
    nframes = sum(s.nframes for s in stat.systems)
    ratio = content["sel_ratio"]
    lines = [
        f"neighbour statistics of {len(stat.systems)} systems, {nframes} frames, "
        f"rcut {stat.rcut:g} Å",
        "",
    ]
    header = ["type", "max neighbours", f"sel (auto:{ratio:g})"]
    rows = [
        [name, str(stat.max_nbor_size[t]), str(content["sel"][t])]
        for t, name in enumerate(type_map)
    ]
    rows.append(["all types", str(stat.max_nbor_total), str(content["sel_total"])])
    if isinstance(input_sel, (list, int)):  # the input's own sel, beside the figures
        header.append("sel in input")
        if mixed:  # one sel for all types: a list stands for its sum
            total = sum(input_sel) if isinstance(input_sel, list) else input_sel
            given = ["-"] * len(type_map) + [str(total)]
        else:
            listed = input_sel if isinstance(input_sel, list) else []
            given = [str(listed[t]) if t < len(listed) else "-" for t in range(len(type_map))]
            given.append("-")
        rows = [[*row, cell] for row, cell in zip(rows, given, strict=True)]
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    for row in [header, *rows]:
        cells = (cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    if math.isfinite(stat.min_nbor_dist):
        lines.append(f"min_nbor_dist: {stat.min_nbor_dist:.6f} Å")
    else:
        lines.append("min_nbor_dist: undefined (no two atoms found)")
    lines.append(f"max_nbor_size: {stat.max_nbor_size}")
    lines.append(f"max_nbor_total: {stat.max_nbor_total} (all types together)")
    if mixed:
        lines.append(
            f'the input\'s descriptor takes one sel for all types: "auto" gives '
            f"{content['sel_total']}"
        )
    lines.append(f"written to {output}")
    return "\n".join(lines)
