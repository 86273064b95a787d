"""Command-line interface: argument parsing and dispatch only."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from mdtrain import __version__
from mdtrain.errors import MDTrainError
from mdtrain.log import setup_logging

# command name -> "module:function" in mdtrain.commands; the function takes the parsed
# arguments, returns an exit code. Imported on dispatch, so a command loads only what it needs.
_HANDLERS = {
    "check": "mdtrain.commands.check:run_check",
    "neighbor-stat": "mdtrain.commands.neighbor_stat:run_neighbor_stat",
    "train": "mdtrain.commands.train:run_train",
    "test": "mdtrain.commands.test:run_test",
    "freeze": "mdtrain.commands.freeze:run_freeze",
    "plot": "mdtrain.commands.plot:run_plot",
    "convert": "mdtrain.commands.convert:run_convert",
    "model-devi": "mdtrain.commands.model_devi:run_model_devi",
    "change-bias": "mdtrain.commands.change_bias:run_change_bias",
    "show": "mdtrain.commands.show:run_show",
}
# commands that, run as a program, end without tearing the interpreter down: their files
# are written and closed, no thread is left, and freeing every module and cached array
# costs about 0.05 s, 4 % of neighbor-stat on thousands of small systems
_QUICK_EXIT = frozenset({"neighbor-stat"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mdtrain", description="Train DeePMD-style interatomic potentials."
    )
    parser.add_argument("--version", action="version", version=f"mdtrain {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="validate input.json and the systems it names")
    p.add_argument("input", help="input.json")

    p = sub.add_parser("neighbor-stat", help="neighbour statistics: min distance, max counts, sel")
    p.add_argument("input", nargs="?", help="input.json (systems, rcut and type_map from it)")
    p.add_argument(
        "-s", "--system", nargs="+", help="systems (directories, .h5 files or file.h5#/group)"
    )
    p.add_argument("-r", "--rcut", type=float, help="cutoff radius in Å")
    p.add_argument("-t", "--type-map", nargs="+", help="element names, in model type order")
    p.add_argument("-o", "--output", default="neighbor_stat.json", help="JSON file to write")
    p.add_argument(
        "--sel-ratio",
        type=float,
        help='ratio for the "auto" sel (default: the input\'s "auto:x", else 1.1)',
    )

    p = sub.add_parser("train", help="train a model (also under torchrun, srun or mpirun)")
    p.add_argument("input", help="input.json")
    p.add_argument("--restart", metavar="CKPT", help='checkpoint to continue from, or "auto"')
    p.add_argument(
        "--init-model", metavar="MODEL",
        help="start from the weights and statistics of a checkpoint or a DeePMD-kit .dp model",
    )  # fmt: skip
    p.add_argument(
        "--finetune", metavar="MODEL",
        help="fine-tune a checkpoint or DeePMD-kit .dp model on this input's data: its "
        "architecture, its nets for the elements it knows, the input's type_map, the energy "
        "bias refitted",
    )  # fmt: skip
    p.add_argument(
        "--backend", choices=["auto", "nccl", "gloo", "mpi"], help="process-group backend"
    )
    p.add_argument("--neighbor-stat-file", help="use a file written by `mdtrain neighbor-stat`")
    p.add_argument("--skip-neighbor-stat", action="store_true", help="trust the list sel given")
    p.add_argument(
        "--mixed-precision",
        choices=["off", "tf32", "bf16", "fp16"],
        help="override training.mixed_precision (GPUs; needs float32 networks)",
    )
    p.add_argument(
        "--ensemble", type=int, metavar="N",
        help="train a committee of N models in this run (member k: the model seeds + k), "
        "in member-0/ ... member-N-1/; overrides training.ensemble",
    )  # fmt: skip
    p.add_argument("-o", "--output-dir", default=".", help="where checkpoints and logs go")

    p = sub.add_parser("test", help="evaluate a model on systems: RMSE and MAE tables")
    p.add_argument(
        "-m", "--model", required=True,
        help="checkpoint .pt, frozen .pth, exported .pt2, DeePMD-kit .dp, or a training output "
        "folder (its model.ckpt.pt)",
    )  # fmt: skip
    p.add_argument("-s", "--system", nargs="+", required=True, help="systems to test on")
    p.add_argument("-n", "--numb-test", type=int, default=0, help="frames per system (0: all)")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.add_argument("--parity", help="draw predicted-vs-reference plots to this PNG file")
    p.add_argument(
        "-d", "--detail-file", metavar="PREFIX",
        help="write DeePMD-kit's per-frame files PREFIX.e.out, .e_peratom.out, .f.out, .v.out, "
        ".v_peratom.out (and .s.out), as `dp test -d` does (a dipole or polar model: PREFIX.out, "
        ".out.1, ... one per system; DOS, property: one per frame)",
    )  # fmt: skip
    p.add_argument(
        "-a", "--atomic", action="store_true",
        help="with -d, a dipole or polar model's files hold the atomic tensors of the atoms of "
        "sel_type (atomic_dipole.npy, atomic_polarizability.npy), as `dp test -a -d` does",
    )  # fmt: skip
    p.add_argument(
        "--torchscript",
        action="store_true",
        help="run a frozen model as its TorchScript module (as a deployment would) instead of "
        "loading its weights into the faster eager model",
    )
    p.add_argument(
        "--live-weights",
        action="store_true",
        help="a checkpoint of a run with training.enable_ema: its live weights instead of "
        "their average",
    )

    p = sub.add_parser(
        "freeze",
        help="export a model: TorchScript (.pth), torch.export (.pt2) or DeePMD-kit's model "
        "file (.dp)",
    )
    p.add_argument(
        "checkpoint",
        nargs="?",
        help="checkpoint (.pt), a DeePMD-kit model (.dp), or a training output directory "
        "(its model.ckpt.pt)",
    )
    p.add_argument(
        "-c", "--checkpoint", dest="checkpoint_option", metavar="CHECKPOINT",
        help="the same, DeePMD-kit's spelling (default: the current directory)",
    )  # fmt: skip
    p.add_argument(
        "-o", "--output", default="model.pth",
        help="file to write: *.dp is DeePMD-kit's model file (for dp, LAMMPS via "
        "`dp convert-backend`), *.pt2 a torch.export program, anything else TorchScript",
    )  # fmt: skip
    p.add_argument(
        "--live-weights",
        action="store_true",
        help="a checkpoint of a run with training.enable_ema: its live weights instead of "
        "their average",
    )

    p = sub.add_parser(
        "change-bias",
        help="refit (-m change, -m set) or set (-b) a model's per-type energy bias, into a new "
        "file (DeePMD-kit's dp change-bias)",
    )
    p.add_argument("model", help="checkpoint .pt, frozen .pth or DeePMD-kit .dp model")
    source = p.add_mutually_exclusive_group()
    source.add_argument("-s", "--system", nargs="+", help="systems (a folder expands; default .)")
    source.add_argument("-f", "--datafile", help="a file listing one system per line")
    source.add_argument(
        "-b", "--bias-value", type=float, nargs="+",
        help="the bias of each element of the model's type_map, in eV",
    )  # fmt: skip
    p.add_argument(
        "-n", "--numb-batch", type=int, default=0,
        help="frames per system (the first ones; 0: all)",
    )  # fmt: skip
    p.add_argument(
        "-m", "--mode", choices=["change", "set"], default="change",
        help="change: add the least-squares fit of the energy errors; set: the fit of the "
        "label energies",
    )  # fmt: skip
    p.add_argument("-o", "--output", help="file to write (default: MODEL_updated.<suffix>)")

    p = sub.add_parser(
        "show", help="a model's type map, descriptor, fitting net, size, rcut, sel (dp show)"
    )
    p.add_argument("model", help="checkpoint .pt, frozen .pth or DeePMD-kit .dp model")
    p.add_argument(
        "attributes", nargs="*", metavar="ATTRIBUTE",
        help="what to show: model-branch, type-map, descriptor, fitting-net, size, "
        "observed-type, rcut, sel (default: type-map descriptor fitting-net size rcut sel)",
    )  # fmt: skip

    p = sub.add_parser("plot", help="plot learning curves from lcurve.out")
    p.add_argument("lcurve", nargs="?", default="lcurve.out")
    p.add_argument("-o", "--output", default="lcurve.png")

    p = sub.add_parser(
        "model-devi",
        help="model deviation of a committee on systems or trajectories (DeePMD-kit's "
        "model_devi.out)",
    )
    p.add_argument(
        "-m", "--models", nargs="+", required=True,
        help="checkpoints, frozen .pth, exported .pt2 or DeePMD-kit .dp models; a committee "
        "folder (member-*/) counts as its members",
    )  # fmt: skip
    p.add_argument(
        "-s", "--system", nargs="+", required=True,
        help="deepmd/npy or HDF5 systems (a folder expands), or trajectories ASE or dpdata read",
    )  # fmt: skip
    p.add_argument("-o", "--output", default="model_devi.out", help="file to write")
    p.add_argument(
        "-f", "--frequency", type=int,
        help="MD steps between frames: step = frame index x this (default: a LAMMPS dump's own "
        "timesteps, else 1)",
    )  # fmt: skip
    p.add_argument("--format", default="auto", help="trajectory format (dpdata or ASE name)")
    p.add_argument(
        "-t", "--type-map", nargs="+",
        help="element of each LAMMPS dump type, type 1 first (default: the model's type_map)",
    )  # fmt: skip
    p.add_argument("--atomic", action="store_true", help="also write every atom's force deviation")
    p.add_argument(
        "--relative", type=float, metavar="LEVEL",
        help="force deviation relative to the mean force: eps_f / (|<F>| + LEVEL)",
    )  # fmt: skip
    p.add_argument(
        "--relative-v", "--relative_v", dest="relative_v", type=float, metavar="LEVEL",
        help="virial deviation relative to the mean virial: eps_v / (|<W/N>| + LEVEL)",
    )  # fmt: skip
    p.add_argument("--trust-lo", type=float, help="count frames below/between/above the trust")
    p.add_argument("--trust-hi", type=float, help="levels on max_devi_f (dpgen's selection)")

    p = sub.add_parser("convert", help="convert DFT outputs to deepmd/npy or deepmd/hdf5")
    p.add_argument("inputs", nargs="+", help="files or directories dpdata or ASE can read")
    p.add_argument("-o", "--output", required=True, help="output directory or .h5/.hdf5 file")
    p.add_argument("-f", "--format", default="auto", help="input format (dpdata or ASE name)")
    p.add_argument(
        "--to",
        choices=["deepmd/npy", "deepmd/hdf5", "deepmd/npy/mixed", "deepmd/hdf5/mixed"],
        help="default: from -o suffix; /mixed: mixed-type systems, one per atom count",
    )
    p.add_argument(
        "--atom-numb-pad",
        type=int,
        help="with --to .../mixed: pad atom counts to a multiple of N with virtual atoms",
    )
    p.add_argument("-t", "--type-map", nargs="+", help="element order of type.raw")
    p.add_argument("--valid-fraction", type=float, default=0.0, help="frames held out")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    p.add_argument(
        "--set-size", type=int, help="frames per set.* (default 5000; --pack: the sources' sets)"
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="copy deepmd systems as they are into one HDF5 file, one group each, streamed",
    )
    p.add_argument(
        "--compression", choices=["none", "lzf", "gzip"], help="with --pack (default none)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(debug=args.debug)
    code = _run(args)
    if argv is None and args.command in _QUICK_EXIT:  # the process is this command
        logging.shutdown()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed pipe: as Python's own exit reports it
            return code
        os._exit(code)
    return code


def _run(args: argparse.Namespace) -> int:
    module_name, function_name = _HANDLERS[args.command].split(":")
    try:
        handler = getattr(importlib.import_module(module_name), function_name)
        return int(handler(args) or 0)
    except MDTrainError as exc:
        if args.debug:
            raise
        logging.getLogger("mdtrain").error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
