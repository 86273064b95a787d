"""``mdtrain convert``: DFT/MD outputs → deepmd/npy or deepmd/hdf5, by `mdtrain.data.convert`."""

from __future__ import annotations

import argparse
import logging

from mdtrain.data.convert import convert
from mdtrain.errors import MDTrainError
from mdtrain.outputs import check_output_dir, check_output_file

log = logging.getLogger("mdtrain.convert")


def run_convert(args: argparse.Namespace) -> int:
    """Entry point of ``mdtrain convert`` (arguments defined in mdtrain/cli.py)."""
    output = args.output
    to = args.to or ("deepmd/hdf5" if output.endswith((".h5", ".hdf5")) else "deepmd/npy")
    if not 0.0 <= args.valid_fraction < 1.0:
        raise MDTrainError(f"--valid-fraction {args.valid_fraction}: must be in [0, 1)")
    if args.set_size < 1:
        raise MDTrainError(f"--set-size {args.set_size}: must be at least 1")
    if to == "deepmd/hdf5":  # checked before any input is read
        check_output_file(output, "-o", create_parents=True)
    else:
        check_output_dir(output, "-o")
    splits = convert(
        args.inputs,
        output,
        to,
        fmt=args.format,
        type_map=args.type_map,
        valid_fraction=args.valid_fraction,
        seed=args.seed,
        set_size=args.set_size,
    )
    for part, group in splits.items():
        total = sum(data.nframes for data in group.values())
        where = f"{output}/{part}" if part else output
        log.info("%s: %d systems, %d frames (%s)", where, len(group), total, to)
    return 0
