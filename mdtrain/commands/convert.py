"""``mdtrain convert``: DFT/MD outputs → deepmd/npy or deepmd/hdf5, by `mdtrain.data.convert`;
with ``--pack``, deepmd systems copied as they are into one HDF5 file, by `mdtrain.data.pack`."""

from __future__ import annotations

import argparse
import logging

from mdtrain.data.convert import convert
from mdtrain.errors import MDTrainError
from mdtrain.outputs import KIND_DATA, Output, check_outputs

log = logging.getLogger("mdtrain.convert")

DEFAULT_SET_SIZE = 5000


def run_convert(args: argparse.Namespace) -> int:
    """Entry point of ``mdtrain convert`` (arguments defined in mdtrain/cli.py)."""
    output = args.output
    to = args.to or ("deepmd/hdf5" if output.endswith((".h5", ".hdf5")) else "deepmd/npy")
    if args.set_size is not None and args.set_size < 1:
        raise MDTrainError(f"--set-size {args.set_size}: must be at least 1")
    pad = getattr(args, "atom_numb_pad", None)
    if pad is not None and (pad < 1 or not to.endswith("/mixed")):
        raise MDTrainError(
            f"--atom-numb-pad {pad}: needs --to deepmd/npy/mixed or deepmd/hdf5/mixed and N >= 1"
        )
    if args.pack:
        return _run_pack(args, to)
    if args.compression is not None:
        raise MDTrainError("--compression: only with --pack")
    if not 0.0 <= args.valid_fraction < 1.0:
        raise MDTrainError(f"--valid-fraction {args.valid_fraction}: must be in [0, 1)")
    _check_output(args, to)  # before any input is read
    splits = convert(
        args.inputs,
        output,
        to,
        fmt=args.format,
        type_map=args.type_map,
        valid_fraction=args.valid_fraction,
        seed=args.seed,
        set_size=args.set_size or DEFAULT_SET_SIZE,
        atom_numb_pad=pad,
    )
    for part, group in splits.items():
        total = sum(data.nframes for data in group.values())
        where = f"{output}/{part}" if part else output
        log.info("%s: %d systems, %d frames (%s)", where, len(group), total, to)
    return 0


def _run_pack(args: argparse.Namespace, to: str) -> int:
    """``--pack``: only the options that keep the data as they are."""
    from mdtrain.data.pack import pack

    if to != "deepmd/hdf5":
        raise MDTrainError(f"--pack writes one HDF5 file: -o {args.output} needs .h5 or .hdf5")
    for given, option in (
        (args.format != "auto", "-f"),
        (args.type_map, "-t"),
        (args.valid_fraction, "--valid-fraction"),
    ):
        if given:
            raise MDTrainError(f"{option}: not with --pack (it copies deepmd systems as they are)")
    _check_output(args, to)
    packed = pack(args.inputs, args.output, args.compression or "none", args.set_size)
    frames = sum(p.nframes for p in packed)
    log.info("%s: %d systems, %d frames (deepmd/hdf5, packed)", args.output, len(packed), frames)
    return 0


def _check_output(args: argparse.Namespace, to: str) -> None:
    """``-o`` is no input, and an existing HDF5 file there holds data (not a model, not
    statistics); checked before any input is read."""
    if to.startswith("deepmd/hdf5"):
        output = Output("-o", args.output, KIND_DATA, create=True)
    else:
        output = Output("-o", args.output, directory=True)
    check_outputs([output], [("input", path) for path in args.inputs])
