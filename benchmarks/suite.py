"""Side-by-side benchmark suite: mdtrain, and DeePMD-kit when its environment is given.

    python benchmarks/suite.py DATA [--deepmd-env VENV] [--only PARTS] [--repeat 3]
        [--steps 300] [--warmup 30] [--precision float64 float32] [--threads 2]
        [--test-frames 0] [--quick] [--json FILE] [--keep]

DATA is an ``input.json`` or a directory holding one, with the systems it names below it.
Parts (``--only neighbor-stat,train,test,ranks``; all by default):

- ``neighbor-stat``: ``mdtrain neighbor-stat -s DATA_DIR -r RCUT -t TYPES`` against
  ``dp --pt neighbor-stat`` with the same arguments (every system under the data directory),
  whole process; checks that both find the same minimal distance and neighbour counts;
- ``train``: training step time (median over ``--steps`` steps after ``--warmup``, batch 1,
  per precision) and peak RSS of the whole training process. mdtrain: the real Trainer,
  timed by ``benchmarks/train_step.py``; DeePMD-kit: ``dp --pt train`` with ``disp_freq`` 1,
  each step's time from the arrival times of its "Batch N: total wall time" lines;
- ``test``: frames/s of ``mdtrain test`` (checkpoint, and frozen model) and ``dp --pt test``
  (frozen model, float64 unless --precision starts with float32) on the validation systems
  (else the training systems), for a model trained one step: whole process, and the
  evaluation alone (the time of a run on one frame per system subtracted);
- ``ranks``: ``mdtrain train`` with 1 rank × 2 threads against ``torchrun --standalone
  --nproc_per_node=2 -m mdtrain train`` with 2 ranks × 1 thread (Gloo), whatever
  ``--threads``: frames/s per global step (step times from the log, as for DeePMD-kit).
  DeePMD-kit cannot run this on a CPU-only torch (its torchrun path needs NCCL): n/a.

Each timed command is a fresh process with ``OMP_NUM_THREADS`` (and DeePMD-kit's
``DP_INTRA_OP_PARALLELISM_THREADS``) set to ``--threads``; peak RSS is that process's own
(``wait4``). With ``--deepmd-env`` the programs alternate (mdtrain, DeePMD-kit, mdtrain, ...
for ``--repeat`` rounds) so that both see the same machine load; a ratio is the median over
the rounds of DeePMD-kit's cost over mdtrain's. The inputs of both come from the same
input.json, written to a temporary directory (never next to the data): systems made
absolute, batch size 1, no validation, no stat_file, ``disp_freq`` 1, the step count and
precision of the measurement; DeePMD-kit's copy also drops the keys that only mdtrain knows
(``MDTRAIN_ONLY``). Prints a Markdown table for docs/performance.md; ``--json FILE`` (``-``:
stdout) writes every figure. ``--quick``: 4 steps after 2, one round, 2 test frames.

This file is the command line; the parts are in ``suite_parts.py``, the inputs, processes and
rounds they share in ``suite_runs.py``, the Markdown report in ``suite_report.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile

from neighbor_stat import ChildFailed
from suite_parts import Suite
from suite_report import markdown
from suite_runs import log, machine_info
from train_step import find_input

PARTS = ("neighbor-stat", "train", "test", "ranks")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="input.json, or a directory holding one and its systems")
    parser.add_argument("--deepmd-env", help="virtual environment holding DeePMD-kit (bin/dp)")
    parser.add_argument("--only", help=f"comma-separated parts: {','.join(PARTS)}")
    parser.add_argument("--repeat", type=int, help="rounds (default 3; --quick: 1)")
    parser.add_argument("--steps", type=int, help="timed steps (default 300; --quick: 4)")
    parser.add_argument("--warmup", type=int, help="steps before timing (default 30; --quick: 2)")
    parser.add_argument("--precision", nargs="+", choices=["float64", "float32"],
                        default=["float64", "float32"])  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="threads per process (default 2)")
    parser.add_argument("--test-frames", type=int,
                        help="test frames per system (default 0: all; --quick: 2)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny step counts, one round")
    parser.add_argument("--json", help="write every figure to this file (- for stdout)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    defaults = {"repeat": 3, "steps": 300, "warmup": 30, "test_frames": 0}
    if args.quick:
        defaults = {"repeat": 1, "steps": 4, "warmup": 2, "test_frames": 2}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = [p.strip() for p in args.only.split(",")] if args.only else list(PARTS)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"--only: unknown part {', '.join(unknown)}; parts: {', '.join(PARTS)}")
    if min(args.repeat, args.steps, args.warmup, args.threads) < 1 or args.test_frames < 0:
        parser.error("--repeat, --steps, --warmup and --threads must be at least 1")
    if args.deepmd_env:
        args.deepmd_env = os.path.abspath(args.deepmd_env)
        if not os.access(os.path.join(args.deepmd_env, "bin", "dp"), os.X_OK):
            parser.error(f"--deepmd-env {args.deepmd_env}: no executable bin/dp in it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    input_path = find_input(args.data)
    work = tempfile.mkdtemp(prefix="mdtrain-suite-")
    suite = Suite(args, input_path, work)
    settings = ("parts", "repeat", "steps", "warmup", "precision", "threads", "test_frames",
                "quick", "deepmd_env")  # fmt: skip
    report: dict = {
        "input": input_path,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(args.deepmd_env),
        "settings": {key: getattr(args, key) for key in settings},
        "load_average": {"before": list(os.getloadavg())},
        "parts": {},
        "table": [],
    }
    failed = False
    try:
        for part in args.parts:
            before = list(os.getloadavg())
            try:
                details, rows = getattr(suite, part.replace("-", "_"))()
            except (ChildFailed, RuntimeError) as exc:
                log(f"[{part}] failed: {exc}")
                details, rows = {"error": str(exc).splitlines()[0]}, []
            details["load_average"] = {"before": before, "after": list(os.getloadavg())}
            report["parts"][part] = details
            report["table"] += rows
            failed |= "error" in details or any(
                isinstance(r["mdtrain"], dict) and "error" in r["mdtrain"] for r in rows
            )
    finally:
        report["load_average"]["after"] = list(os.getloadavg())
        if args.keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown(report))
    if args.json == "-":
        print(json.dumps(report, indent=1))
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
            handle.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
