"""``mdtrain model-devi -m M0 M1 ... -s SYSTEM_OR_TRAJECTORY... -o model_devi.out``: how much a
committee of models disagrees on frames, written as DeePMD-kit 3.2's ``model_devi.out``
(`mdtrain.infer.model_devi`). docs/active-learning.md describes the file and its use."""

from __future__ import annotations

import argparse
import logging

import numpy as np
import torch

from mdtrain.data.trajectory import open_frame_sources
from mdtrain.errors import MDTrainError
from mdtrain.heap import keep_freed_memory
from mdtrain.infer.committee import expand_models, load_committee
from mdtrain.infer.model_devi import (
    committee_model_devi,
    frame_steps,
    trust_counts,
    write_model_devi,
)
from mdtrain.memory import InferenceChunker
from mdtrain.outputs import KIND_MODEL_DEVI, Output, check_outputs
from mdtrain.progress import progress

log = logging.getLogger("mdtrain.model_devi")


def _check_levels(args: argparse.Namespace) -> None:
    for option, value in (("--relative", args.relative), ("--relative-v", args.relative_v)):
        if value is not None and not value > 0:
            raise MDTrainError(f"{option} must be a positive level, got {value}")
    if args.frequency is not None and args.frequency <= 0:
        raise MDTrainError(
            f"-f/--frequency must be a positive number of steps, got {args.frequency}"
        )
    if (args.trust_lo is None) != (args.trust_hi is None):
        raise MDTrainError("--trust-lo and --trust-hi go together")
    if args.trust_lo is not None and not 0 <= args.trust_lo <= args.trust_hi:
        raise MDTrainError(
            f"--trust-lo {args.trust_lo} --trust-hi {args.trust_hi}: need 0 <= lo <= hi"
        )


def run_model_devi(args: argparse.Namespace) -> int:
    """Entry point of ``mdtrain model-devi``."""
    _check_levels(args)
    inputs = [("-m", m) for m in expand_models(args.models)] + [("-s", s) for s in args.system]
    # before any model or frame is read
    check_outputs([Output("-o", args.output, KIND_MODEL_DEVI)], inputs)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    keep_freed_memory()
    models, files = load_committee(args.models, device)
    log.info("committee of %d: %s", len(files), " ".join(files))
    type_map = list(models[0].type_map)
    sources = open_frame_sources(args.system, type_map, args.format, args.type_map)
    total = sum(s.nframes for s in sources)
    log.info(
        "model deviation of %d models on %d frame(s) in %d system(s)", len(models), total,
        len(sources),
    )  # fmt: skip
    chunker = InferenceChunker(device=device)
    bar = progress(iter(range(total)), total, "model-devi")

    def advance(n: int) -> None:
        for _ in range(n):
            next(bar, None)

    max_devi_f = []
    try:
        handle = open(args.output, "w")  # noqa: SIM115 (closed below; this names the open)
    except OSError as exc:
        raise MDTrainError(f"-o {args.output}: cannot write ({exc.strerror or exc})") from None
    with handle:
        for source in sources:
            deviation = committee_model_devi(
                models, source, device, chunker, advance, args.relative, args.relative_v, files
            )
            steps = frame_steps(source, args.frequency)
            write_model_devi(handle, source.path, steps, deviation, args.atomic)
            handle.flush()
            max_devi_f.append(deviation.force[:, 0])
    for _ in bar:  # let the progress reporter finish
        pass
    values = np.concatenate(max_devi_f)
    log.info(
        "max_devi_f: largest %.4g, median %.4g over %d frame(s); wrote %s",
        values.max(), np.median(values), values.size, args.output,
    )  # fmt: skip
    if args.trust_lo is not None:
        counts = trust_counts(values, args.trust_lo, args.trust_hi)
        print(
            f"max_devi_f < {args.trust_lo:g} (accurate): {counts['accurate']}\n"
            f"{args.trust_lo:g} <= max_devi_f < {args.trust_hi:g} (candidate): "
            f"{counts['candidate']}\n"
            f"max_devi_f >= {args.trust_hi:g} (failed): {counts['failed']}"
        )
    return 0
