"""``mdtrain change-bias MODEL (-s SYSTEMS | -f LIST | -b VALUES) [-n N] [-m change|set]
[-o OUTPUT]``: DeePMD-kit's ``dp change-bias`` on a checkpoint, a ``.dp`` file or a frozen
model (`mdtrain.infer.change_bias`), written to a new file; the input is never replaced."""

from __future__ import annotations

import argparse
import logging
import os

from mdtrain.data import expand_systems, open_system
from mdtrain.data.labels import output_labels
from mdtrain.errors import MDTrainError
from mdtrain.infer.change_bias import (
    default_output,
    fit_bias,
    given_bias,
    read_model,
    write_model,
)
from mdtrain.infer.change_output_bias import fit_output_bias
from mdtrain.outputs import Output, check_outputs, file_kind

log = logging.getLogger("mdtrain.change_bias")


def _system_paths(args: argparse.Namespace) -> list[str]:
    if args.datafile:
        try:
            with open(args.datafile, encoding="utf-8") as handle:
                entries = [line.strip() for line in handle if line.strip()]
        except OSError as exc:
            raise MDTrainError(f"-f {args.datafile}: cannot read ({exc.strerror})") from None
        return [p for entry in entries for p in expand_systems(entry, os.getcwd())]
    return expand_systems(args.system or ".", os.getcwd())


def run_change_bias(args: argparse.Namespace) -> int:
    """Entry point of ``mdtrain change-bias``."""
    output = args.output or default_output(args.model)
    inputs = [("model", args.model), ("-f", args.datafile)]
    inputs += [("-s", path) for path in args.system or []]
    # the input is never replaced, nor any file of another kind; before any work
    check_outputs([Output("-o", output, file_kind(args.model))], inputs)
    if args.numb_batch < 0:
        raise MDTrainError(f"-n/--numb-batch must be >= 0, got {args.numb_batch}")
    model, state = read_model(args.model)
    if getattr(model, "output", None) is not None:  # a DOS or property model
        return _change_output_bias(args, model, state, output)
    if getattr(model, "label", None) is not None:  # a dipole or polar model
        raise MDTrainError(
            f"model {args.model}: change-bias changes energy, DOS and property models, not a "
            f"{model.kind} model"
        )
    if not hasattr(model, "set_out_bias"):
        raise MDTrainError(
            f"model {args.model}: a frozen model without its model_config; change the bias "
            "of its checkpoint instead"
        )
    old = model.out_bias.detach().cpu().numpy().copy()
    if args.bias_value is not None:
        model.set_out_bias(given_bias(model, args.bias_value))
    else:
        systems = [open_system(p, list(model.type_map)) for p in _system_paths(args)]
        counts = [min(args.numb_batch or s.nframes, s.nframes) for s in systems]
        bias, std = fit_bias(model, systems, counts, args.mode)
        model.set_out_bias(bias, std)
        log.info("fitted on %d frames of %d system(s)", sum(counts), len(systems))
    new = model.out_bias.detach().cpu().numpy()
    for name, before, after in zip(model.type_map, old, new, strict=True):
        print(f"{name}: {before:.10g} -> {after:.10g}")
    write_model(model, args.model, state, output)
    log.info("saved the model with the changed bias to %s", output)
    return 0


def _change_output_bias(args: argparse.Namespace, model, state: dict, output: str) -> int:
    """``change-bias`` of a DOS or property model (`mdtrain.infer.change_output_bias`)."""
    if args.bias_value is not None:
        raise MDTrainError(
            f"-b/--bias-value: only an energy model's bias can be given (model {args.model} "
            f"is a {model.kind} model; use -m change or -m set)"
        )
    if not hasattr(model, "get_model_config"):
        raise MDTrainError(
            f"model {args.model}: a frozen model without its model_config; change the bias "
            "of its checkpoint instead"
        )
    labels = output_labels(model.get_model_config())
    systems = [open_system(p, list(model.type_map), labels) for p in _system_paths(args)]
    counts = [min(args.numb_batch or s.nframes, s.nframes) for s in systems]
    old = model.out_bias.detach().cpu().numpy().copy()
    bias, std = fit_output_bias(model, systems, counts, args.mode)
    model.set_out_bias(bias, std)
    log.info("fitted on %d frames of %d system(s)", sum(counts), len(systems))
    for name, before, after in zip(model.type_map, old, bias, strict=True):
        print(f"{name}: {model.output} bias (mean of {before.size} values) "
              f"{before.mean():.10g} -> {after.mean():.10g}")  # fmt: skip
    write_model(model, args.model, state, output)
    log.info("saved the model with the changed bias to %s", output)
    return 0
