"""``mdtrain freeze [CKPT | -c CKPT] -o OUTPUT [--live-weights]``: a checkpoint (an EMA run's
with its averaged weights, `mdtrain.model.files.model_weights`) or a DeePMD-kit ``.dp`` model
→ the file the output's suffix names: ``.dp`` is DeePMD-kit's model file
(`mdtrain.model.deepmd_file`), ``.pt2`` a ``torch.export`` program, anything else mdtrain's
TorchScript file (both `mdtrain.infer.freeze`)."""

from __future__ import annotations

import argparse
import logging

from mdtrain.errors import MDTrainError
from mdtrain.infer.freeze import export_model, freeze_model
from mdtrain.infer.load import is_torchscript, model_file, model_from_checkpoint, weights_note
from mdtrain.infer.program import is_exported_program
from mdtrain.model.deepmd_file import tf_conversion_caveats, write_dp
from mdtrain.model.files import load_model_file, model_weights
from mdtrain.outputs import KIND_DP, KIND_EXPORTED, KIND_FROZEN, Output, check_outputs

log = logging.getLogger("mdtrain.freeze")


def run_freeze(args: argparse.Namespace) -> int:
    """Entry point of ``mdtrain freeze [CKPT | -c CKPT] -o OUTPUT``."""
    if args.checkpoint and args.checkpoint_option:
        raise MDTrainError("freeze: give the checkpoint once, as an argument or with -c")
    # a training output directory, as DeePMD-kit's -c: its model.ckpt.pt
    checkpoint = model_file(args.checkpoint or args.checkpoint_option or ".")
    suffix = args.output.rsplit(".", 1)[-1]
    kind = {"dp": KIND_DP, "pt2": KIND_EXPORTED}.get(suffix, KIND_FROZEN)
    # before the checkpoint is read and scripted
    check_outputs([Output("-o", args.output, kind)], [("checkpoint", checkpoint)])
    if is_torchscript(checkpoint):
        raise MDTrainError(f"checkpoint {checkpoint}: already a frozen (TorchScript) model")
    if is_exported_program(checkpoint):
        raise MDTrainError(f"checkpoint {checkpoint}: already an exported (.pt2) model")
    state = load_model_file(checkpoint, live=True)  # as stored
    note = weights_note(checkpoint, state, args.live_weights)
    if note:
        log.info("%s", note)
    state = model_weights(state, args.live_weights, f"checkpoint {checkpoint}")
    model = model_from_checkpoint(state, f"checkpoint {checkpoint}")
    if args.output.endswith(".dp"):
        write_dp(model, args.output, state.get("min_nbor_dist"))
        for caveat in tf_conversion_caveats(model):
            log.warning("%s", caveat)
    elif args.output.endswith(".pt2"):
        export_model(model, args.output, {"step": int(state.get("step", 0))})
    else:
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
