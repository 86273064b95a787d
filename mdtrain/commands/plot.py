"""``mdtrain plot [lcurve.out] -o lcurve.png``: learning curves drawn by `mdtrain.plot`."""

from __future__ import annotations

import argparse
import logging

from mdtrain.errors import MDTrainError
from mdtrain.outputs import KIND_PNG, Output, check_outputs
from mdtrain.plot import parse_lcurve, plot_lcurve

log = logging.getLogger("mdtrain.plot")


def run_plot(args: argparse.Namespace) -> int:
    """CLI handler: ``mdtrain plot [lcurve.out] -o lcurve.png``."""
    kind = KIND_PNG if str(args.output).lower().endswith(".png") else None
    check_outputs([Output("-o", args.output, kind)], [("lcurve", args.lcurve)])
    columns = parse_lcurve(args.lcurve)
    if len(columns["step"]) == 0:
        raise MDTrainError(f"{args.lcurve}: no data rows yet; nothing to plot")
    output = plot_lcurve(columns, args.output, title=str(args.lcurve))
    step = columns["step"]
    log.info("wrote %s (%d rows, steps %d to %d)", output, len(step), step[0], step[-1])
    return 0
