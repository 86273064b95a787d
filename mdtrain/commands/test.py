"""``mdtrain test``: RMSE and MAE tables of a model on systems, computed by `mdtrain.infer.test`.

Figures are printed per system and pooled over all systems; ``--json`` writes them to a file
and ``--parity`` draws predicted-vs-reference plots.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch

from mdtrain.data import System, expand_systems, open_systems
from mdtrain.data.labels import output_labels
from mdtrain.errors import MDTrainError
from mdtrain.heap import keep_freed_memory
from mdtrain.infer.detail import detail_paths, remove_stale, write_details
from mdtrain.infer.detail_output import write_output_details
from mdtrain.infer.detail_tensor import (
    check_detail_labels,
    tensor_detail_path,
    write_tensor_details,
)
from mdtrain.infer.load import load_model, model_file
from mdtrain.infer.test import ErrorSums, SystemResult, draw_parity, evaluate_system, format_table
from mdtrain.memory import InferenceChunker
from mdtrain.outputs import KIND_JSON, KIND_PNG, Output, check_outputs
from mdtrain.progress import progress

log = logging.getLogger("mdtrain.test")


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _frames_to_test(system: System, numb_test: int) -> int:
    if numb_test < 0:
        raise MDTrainError(f"-n/--numb-test must be >= 0, got {numb_test}")
    if numb_test == 0 or numb_test >= system.nframes:
        return system.nframes
    return numb_test


def _expand(entries: list[str]) -> tuple[list[str], list[str]]:
    """The systems, and their names in the detail files: as DeePMD-kit prints them, relative
    when the entry was given relative, absolute otherwise."""
    paths, labels = [], []
    for entry in entries:
        for path in expand_systems(entry, os.getcwd()):
            if path not in paths:
                paths.append(path)
                labels.append(path if os.path.isabs(entry) else os.path.relpath(path))
    return paths, labels


def run_test(args: argparse.Namespace) -> int:
    """Entry point of ``mdtrain test -m MODEL -s SYSTEM... [-n N] [--json F] [--parity F]
    [-d PREFIX [-a]] [--torchscript] [--live-weights]``."""
    model_path = model_file(args.model)
    named = [("--json", args.json, KIND_JSON), ("--parity", args.parity, KIND_PNG)]
    if args.detail_file:
        named += [("-d", path, None) for path in detail_paths(args.detail_file)]
    outputs = [Output(option, path, kind) for option, path, kind in named if path]
    inputs = [("-m", model_path), *(("-s", s) for s in args.system)]
    check_outputs(outputs, inputs)  # before any model or system is read
    device = _device()
    keep_freed_memory()
    model = load_model(model_path, device, scripted=args.torchscript, live=args.live_weights)
    type_map = list(model.type_map)
    kind = getattr(model, "label", None)  # a tensor model's
    atomic = bool(getattr(args, "atomic", False))
    if atomic and not kind:
        raise MDTrainError(
            f"model {args.model}: -a/--atomic chooses the detail layout of dipole and polar "
            "models only (a DOS or property model's -d writes its atomic files anyway)"
        )
    own_output = getattr(model, "output", None) is not None  # DOS, property
    outputs = output_labels(json.loads(getattr(model, "model_config_json", "") or "{}"))
    systems, labels = [], []
    for path, name in zip(*_expand(args.system), strict=True):
        # a mixed-type one: its compositions; the model's own label files (DOS, property)
        for system in open_systems(path, type_map, outputs):
            systems.append(system)
            labels.append(name + system.path[len(system.source) :])
    counts = [_frames_to_test(s, args.numb_test) for s in systems]
    if kind and args.detail_file:  # DeePMD-kit's: one file per system, labels required
        check_detail_labels(systems, labels, kind, atomic)
        paths = [tensor_detail_path(args.detail_file, k) for k in range(len(systems))]
        check_outputs([Output("-d", str(p), None) for p in paths], inputs)
    total_frames = sum(counts)
    log.info("testing %s on %d system(s), %d frame(s)", model_path, len(systems), total_frames)

    chunker = InferenceChunker(device=device)
    bar = progress(iter(range(total_frames)), total_frames, "test")

    def advance(n: int) -> None:
        for _ in range(n):
            next(bar, None)

    results: list[SystemResult] = []
    per_system: dict[str, dict] = {}
    total = ErrorSums()
    if args.detail_file:
        remove_stale(args.detail_file)
    for k, (system, n) in enumerate(zip(systems, counts)):
        name = f"model {model_path}"
        result = evaluate_system(model, system, n, device, chunker, advance, name)
        if args.detail_file and kind:
            keep = model.atom_keep.cpu().numpy()[system.atype] > 0
            write_tensor_details(args.detail_file, result, system, kind, atomic, keep, group=k)
        elif args.detail_file and own_output:  # DeePMD-kit's: one file per frame
            write_output_details(args.detail_file, result, system, labels[k], group=k)
        elif args.detail_file:  # DeePMD-kit's files: the first system starts them
            write_details(args.detail_file, result, system, labels[k], append=k > 0)
        errors = result.errors()
        total.merge(errors)
        per_system[system.path] = {"natoms": system.natoms, **errors.summary()}
        results.append(result)
    for _ in bar:  # let the progress reporter finish
        pass

    for path, summary in per_system.items():
        print(
            format_table(
                f"System {path}: {summary['nframes']} frames, {summary['natoms']} atoms", summary
            )
        )
        print()
    totals = {"nsystems": len(systems), **total.summary()}
    print(
        format_table(
            f"Total over {len(systems)} system(s), {total.nframes} frames (pooled errors)", totals
        )
    )

    if args.json:
        _write_json(
            args.json,
            {"model": os.path.abspath(model_path), "systems": per_system, "total": totals},
        )
    if args.parity:
        draw_parity(results, args.parity)
    return 0


def _write_json(path: str, data: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError as exc:
        raise MDTrainError(f"--json {path}: cannot write ({exc.strerror or exc})") from None
    log.info("wrote %s", path)
