"""Start-up on many systems: ``mdtrain check``, ``mdtrain neighbor-stat`` and the time to the
first training step, side by side with DeePMD-kit.

    python benchmarks/startup.py DATA [DATA ...] [--deepmd-env /path/to/venv]
        [--deepmd-backend tf|pt] [--repeat 3] [--threads 1] [--json FILE]

Each ``DATA`` is a folder of deepmd/npy systems (``benchmarks/make_dataset.py --systems 5000
--frames 5`` writes one) or an HDF5 file; it is one ``systems`` entry of an input written to a
temporary folder: se_e2_a with ``sel: "auto"``, rcut 6 Å, the water example's network sizes,
``batch_size: "auto"``, ``numb_steps: 1``, no validation, statistics in memory. Every command
runs in a fresh process from that folder, with ``OMP_NUM_THREADS`` and DeePMD-kit's thread
variables set to ``--threads``; mdtrain and DeePMD-kit alternate for ``--repeat`` rounds.
Measured per command: the wall time of the whole process and its CPU time (user + system,
which a machine shared with other jobs inflates less than the wall time), and for training
the time at which the log line of step 1 arrived (mdtrain ``step 1/1``, DeePMD-kit ``Batch
1:``): everything before the first step (imports, checks, neighbour statistics, data
statistics, building the model) plus that step.

DeePMD-kit: ``dp --BACKEND neighbor-stat -s DATA -r 6 -t TYPES`` and ``dp --BACKEND train
input.json``. It has no command that checks a data set, so ``check`` is mdtrain's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

from neighbor_stat import ChildFailed, ChildRun, mdtrain_command, run_child

TYPE_MAP = ["Al", "Cu", "Ni"]  # benchmarks/lattice_data.py's elements
RCUT = 6.0
MDTRAIN_STEP = re.compile(r"\bstep 1/1\b")
DP_STEP = re.compile(r"Batch\s+1:")
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "TF_INTRA_OP_PARALLELISM_THREADS",
    "TF_INTER_OP_PARALLELISM_THREADS",
    "DP_INTRA_OP_PARALLELISM_THREADS",
    "DP_INTER_OP_PARALLELISM_THREADS",
)


def write_input(data: str, folder: str, rcut: float = RCUT) -> str:
    """A DeePMD-style input both programs read; returns its path."""
    config = {
        "model": {
            "type_map": TYPE_MAP,
            "descriptor": {"type": "se_e2_a", "sel": "auto", "rcut": rcut, "rcut_smth": 0.5,
                           "neuron": [25, 50, 100], "axis_neuron": 16, "seed": 1},
            "fitting_net": {"neuron": [240, 240, 240], "seed": 1},
        },
        "learning_rate": {"type": "exp", "start_lr": 1e-3, "stop_lr": 1e-5, "decay_steps": 100},
        "loss": {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1,
                 "start_pref_f": 1000, "limit_pref_f": 1},
        "training": {
            "training_data": {"systems": os.path.abspath(data), "batch_size": "auto"},
            "numb_steps": 1, "seed": 1, "disp_freq": 1, "save_freq": 1000,
        },
    }  # fmt: skip
    path = os.path.join(folder, "input.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=1)
    return path


def _arrival(run: ChildRun, pattern: re.Pattern) -> float:
    for seconds, line in run.lines:
        if pattern.search(line):
            return seconds
    raise ChildFailed(f"no line matching {pattern.pattern!r} in the log of {run.command[0]}")


def _figures(run: ChildRun, step: re.Pattern | None = None) -> dict:
    out = {"wall_s": run.wall_s, "cpu_s": run.cpu_s, "peak_rss_mib": run.peak_rss_mib}
    if step is not None:
        out["first_step_s"] = _arrival(run, step)
    return out


def measure(data: str, deepmd_env: str | None, backend: str, env: dict) -> dict:
    """One round: every command once, in a fresh folder."""
    folder = tempfile.mkdtemp(prefix="startup_")
    try:
        inp = write_input(data, folder)
        mdtrain = mdtrain_command()
        out = {
            "mdtrain check": _figures(run_child([*mdtrain, "check", inp], env, folder)),
            "mdtrain neighbor-stat": _figures(
                run_child([*mdtrain, "neighbor-stat", inp, "-o", "ns.json"], env, folder)
            ),
            "mdtrain train": _figures(
                run_child([*mdtrain, "train", inp, "-o", "out"], env, folder), MDTRAIN_STEP
            ),
        }
        if deepmd_env:
            dp = [os.path.join(deepmd_env, "bin", "dp"), f"--{backend}"]
            stat = [*dp, "neighbor-stat", "-s", os.path.abspath(data), "-r", str(RCUT)]
            out["dp neighbor-stat"] = _figures(run_child([*stat, "-t", *TYPE_MAP], env, folder))
            out["dp train"] = _figures(run_child([*dp, "train", inp], env, folder), DP_STEP)
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _count(data: str) -> tuple[int, int]:
    """Systems and frames of a data set (through mdtrain, without torch)."""
    from mdtrain.data import expand_systems, open_system

    systems = [open_system(p) for p in expand_systems(data)]
    return len(systems), sum(s.nframes for s in systems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="+", help="folders of systems (or HDF5 files)")
    parser.add_argument("--deepmd-env", help="virtual environment of a DeePMD-kit install")
    parser.add_argument("--deepmd-backend", default="tf", choices=["tf", "pt", "jax"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write every figure to this JSON file")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    env.update({name: str(args.threads) for name in THREAD_VARIABLES})
    report: dict = {"threads": args.threads, "load_before": os.getloadavg(), "data": {}}
    for data in args.data:
        nsys, nframes = _count(data)
        rounds = []
        for _ in range(max(1, args.repeat)):
            rounds.append(measure(data, args.deepmd_env, args.deepmd_backend, env))
            print(f"{data}: {json.dumps(rounds[-1])}", flush=True)
        summary = {}
        for command in rounds[0]:
            summary[command] = {
                key: statistics.median(r[command][key] for r in rounds)
                for key in rounds[0][command]
            }
        report["data"][data] = {"systems": nsys, "frames": nframes, "rounds": rounds,
                                "median": summary}  # fmt: skip
    report["load_after"] = os.getloadavg()
    print(f"\nthreads {args.threads}, load average {report['load_before']} → "
          f"{report['load_after']}; medians of {args.repeat} rounds; wall (CPU) in s\n")  # fmt: skip
    print("| data | command | mdtrain | DeePMD-kit | DeePMD-kit / mdtrain |")
    print("| --- | --- | --- | --- | --- |")
    for entry in report["data"].values():
        med = entry["median"]
        label = f"{entry['systems']} systems, {entry['frames']} frames"
        rows = [("check", "mdtrain check", None, "wall_s"),
                ("neighbour statistics", "mdtrain neighbor-stat", "dp neighbor-stat", "wall_s"),
                ("first training step", "mdtrain train", "dp train", "first_step_s")]  # fmt: skip
        for what, ours, theirs, key in rows:
            a = med[ours]
            cell_a = f"{a[key]:.1f} ({a['cpu_s']:.1f})"
            if theirs and theirs in med:
                b = med[theirs]
                cell_b = f"{b[key]:.1f} ({b['cpu_s']:.1f})"
                ratio = f"{b[key] / a[key]:.1f}× ({b['cpu_s'] / a['cpu_s']:.1f}×)"
            else:
                cell_b, ratio = "—", "—"
            print(f"| {label} | {what} | {cell_a} | {cell_b} | {ratio} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
