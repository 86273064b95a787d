"""``mdtrain freeze [CKPT | -c CKPT] -o OUTPUT``: a checkpoint → a TorchScript file, written by
`mdtrain.infer.freeze`."""

from __future__ import annotations

import argparse
import logging
import os

from mdtrain.errors import MDTrainError
from mdtrain.infer.freeze import freeze_model
from mdtrain.infer.load import is_torchscript, model_from_checkpoint
from mdtrain.model.files import load_checkpoint
from mdtrain.outputs import check_output_file

log = logging.getLogger("mdtrain.freeze")


def run_freeze(args: argparse.Namespace) -> int:
    """Entry point of ``mdtrain freeze [CKPT | -c CKPT] -o OUTPUT``."""
    if args.checkpoint and args.checkpoint_option:
        raise MDTrainError("freeze: give the checkpoint once, as an argument or with -c")
    check_output_file(args.output, "-o")  # before the checkpoint is read and scripted
    checkpoint = args.checkpoint or args.checkpoint_option or "."
    if os.path.isdir(checkpoint):  # a training output directory, as DeePMD-kit's -c
        checkpoint = os.path.join(checkpoint, "model.ckpt.pt")
    if is_torchscript(checkpoint):
        raise MDTrainError(f"checkpoint {checkpoint}: already a frozen (TorchScript) model")
    state = load_checkpoint(checkpoint, map_location="cpu")
    model = model_from_checkpoint(state, f"checkpoint {checkpoint}")
    freeze_model(model, args.output, {"step": int(state.get("step", 0))})
    log.info(
        "froze %s (step %s, type_map %s, rcut %g, sel %s) to %s",
        checkpoint,
        state.get("step", "?"),
        model.type_map,
        model.rcut,
        model.sel,
        args.output,
    )
    return 0
