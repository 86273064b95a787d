"""The cost of a first-epoch training step as a user meets it: whole ``mdtrain train``
processes of the same input for two step counts, the per-step slope between them.

    python benchmarks/first_epoch.py path/to/water [--steps 100 300] [--repeat 2]
        [--prefetch 0 2] [--baseline SRC] [--threads 1] [--precision float64]
        [--deepmd-env VENV] [--json FILE] [--ensemble N] [--steady N]

The argument is a directory holding a DeePMD ``input.json`` and its systems (the water-2000
protocol's). Each run takes that input as it is (validation, display, the last checkpoint)
with ``numb_steps`` set, ``stat_file`` dropped (statistics are recomputed by every run: a
cost of the start, not of a step) and, for mdtrain, ``training.nlist_prefetch`` set to each
``--prefetch`` value (0: every list built in the step; 2: the default, built ahead by a
thread). ``--baseline SRC`` adds mdtrain imported from another source tree (``PYTHONPATH=SRC``,
e.g. the main checkout before a change), its input without ``nlist_prefetch``. With fewer training frames than the larger step count, every step between the two
counts draws frames whose neighbour lists were never built (the first epoch; the water set
has 320). ``--ensemble N`` adds every mdtrain variant again as a committee of N (``mdtrain
train --ensemble N``) and prints the committee's slope over the single model's, round by round.
``--steady N`` adds mdtrain (the first ``--prefetch`` value) on copies of the systems cut to
their first N frames: after a few steps every list is cached, so its slope is the steady
state's; a rough reference only: the statistics, and with them the arithmetic, differ from
the full data's (``--paired-steps --steady`` compares the same frames and model). ``--deepmd-env`` adds ``dp --pt train`` of the same input (DeePMD-kit builds its
lists at every step).

Every run is a fresh process with ``OMP_NUM_THREADS`` (and DeePMD-kit's thread variables) set
to ``--threads``, in a temporary directory; the variants alternate for ``--repeat`` rounds, so
that all see the same load. For each run: wall and CPU time (user + system of the process
and its threads, from ``wait4``); per round the slope ``(T(n2) - T(n1)) / (n2 - n1)`` of
wall and CPU time; the table gives the median of the rounds and their range, and the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from neighbor_stat import mdtrain_command, run_child  # noqa: E402
from suite_runs import MDTRAIN_ONLY, thread_env  # noqa: E402


def run_input(config: dict, base: str, steps: int, precision: str, prefetch: int | None) -> dict:
    """The input of one run: ``steps`` steps, absolute system paths, no stat file; mdtrain's
    ``nlist_prefetch`` when given (-1: not written), DeePMD-kit's copy (``prefetch`` None)
    without mdtrain's own keys."""
    config = json.loads(json.dumps(config))
    for section in ("descriptor", "fitting_net"):
        config["model"][section]["precision"] = precision
    training = config["training"]
    training.pop("stat_file", None)
    training["numb_steps"] = steps
    for name in ("training_data", "validation_data"):
        data = training.get(name)
        if data is not None:
            systems = data["systems"]
            paths = [systems] if isinstance(systems, str) else systems
            data["systems"] = [p if os.path.isabs(p) else os.path.join(base, p) for p in paths]
    if prefetch is None:
        for key in MDTRAIN_ONLY:
            training.pop(key, None)
    elif prefetch >= 0:
        training["nlist_prefetch"] = prefetch
    return config


def truncated_copy(config: dict, base: str, frames: int, dest: str) -> str:
    """Copies under ``dest`` of the input's systems (training and validation, deepmd/npy)
    cut to their first ``frames`` frames of each set; returns ``dest``, where the input's
    relative system paths now lead to the copies."""
    import shutil

    import numpy as np

    for name in ("training_data", "validation_data"):
        data = config["training"].get(name)
        systems = [] if data is None else data["systems"]
        for path in [systems] if isinstance(systems, str) else systems:
            source = path if os.path.isabs(path) else os.path.join(base, path)
            target = os.path.join(dest, os.path.relpath(source, base))
            for root, _, files in os.walk(source):
                here = os.path.join(target, os.path.relpath(root, source))
                os.makedirs(here, exist_ok=True)
                for file in files:
                    if file.endswith(".npy") and os.path.basename(root).startswith("set."):
                        np.save(
                            os.path.join(here, file), np.load(os.path.join(root, file))[:frames]
                        )
                    else:
                        shutil.copy(os.path.join(root, file), here)
    return dest


def one_run(command: list[str], config: dict, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="first-epoch-") as directory:
        with open(os.path.join(directory, "input.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=1)
        done = run_child(command, env, directory)
    return {"wall_s": done.wall_s, "cpu_s": done.cpu_s}


def paired_steps(
    input_path: str,
    steps: int,
    warmup: int,
    depths: list[int],
    threads: int = 1,
    steady: bool = False,
) -> dict:
    """In one process: a trainer per ``nlist_prefetch`` value, every one on the same frames
    (the same seed), their first-epoch steps taken in turn; per step the wall time, the
    process CPU time and the training thread's own CPU time (``time.thread_time``: what the
    step costs the thread that trains, the lists built ahead excluded). ``steady``: also a
    trainer whose cache holds every training frame's lists before its first step (the
    steady state after the first epoch), under the name ``cached``. Also the training
    thread's voluntary context switches per step (Linux): each time it had to wait, for the
    interpreter lock held by the thread building lists ahead among others."""
    import threading
    import time

    import numpy as np
    from train_step import _prepared

    from mdtrain.batching import make_batch
    from mdtrain.model.backend import build_models
    from mdtrain.model.stats import compute_or_load_stats
    from mdtrain.train.loop import Trainer

    config, data, runtime = _prepared(input_path, "float64", steps, warmup, threads, None)
    trainers = []
    names: list[str] = [str(d) for d in depths] + (["cached"] if steady else [])
    with tempfile.TemporaryDirectory() as out_dir:
        for name in names:
            config["training"]["nlist_prefetch"] = 0 if name == "cached" else int(name)
            model = build_models([config["model"]])
            nbatch = int(config["model"].get("data_stat_nbatch", 10))
            compute_or_load_stats(model, data.train, None, nbatch)
            trainer = Trainer(config, model, data.train, data.valid, runtime, out_dir)
            for member in trainer.members:
                member.valid_sampler = None
            if name == "cached":
                rcut, sel, layout = trainer.lists
                for system in data.train:
                    for frame in range(system.nframes):
                        make_batch(system, [frame], rcut, sel, "cpu", trainer.nlist_cache, layout)
                trainer.nlist_cache.misses = 0
            model.train()
            trainers.append(trainer)
        status = f"/proc/self/task/{threading.get_native_id()}/status"

        def waits() -> int:  # the training thread's voluntary context switches (0: unknown)
            if not os.path.exists(status):
                return 0
            with open(status, encoding="utf-8") as handle:
                rows = dict(line.split(":", 1) for line in handle if ":" in line)
            return int(rows.get("voluntary_ctxt_switches", 0))

        times: dict[str, list[tuple[float, float, float, int]]] = {d: [] for d in names}
        for step in range(warmup + steps):
            lr = trainers[0].lr.value(step)
            for depth, trainer in zip(names, trainers, strict=True):
                s0 = waits()
                w0, c0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
                trainer.train_step(lr)
                trainer.step += 1
                spent = (
                    time.perf_counter() - w0,
                    time.process_time() - c0,
                    time.thread_time() - t0,
                    waits() - s0,
                )
                if step >= warmup:
                    times[depth].append(spent)
        taken = {}
        for depth, trainer in zip(names, trainers, strict=True):
            ahead = trainer.prefetch
            taken[depth] = (0 if ahead is None else ahead.used, trainer.nlist_cache.misses)
            if ahead is not None:
                ahead.close()
    out = {}
    for depth, rows in times.items():
        a = np.array(rows)
        out[depth] = {
            "wall_s": float(np.median(a[:, 0])),
            "mean_wall_s": float(np.mean(a[:, 0])),
            "mean_process_cpu_s": float(np.mean(a[:, 1])),
            "mean_thread_cpu_s": float(np.mean(a[:, 2])),
            "process_cpu_s": float(np.median(a[:, 1])),
            "thread_cpu_s": float(np.median(a[:, 2])),
            "thread_waits": float(np.mean(a[:, 3])),
            "lists_built_ahead": taken[depth][0],
            "lists_built": taken[depth][1],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="directory holding input.json and its systems")
    parser.add_argument("--steps", type=int, nargs=2, default=[100, 300])
    parser.add_argument("--repeat", type=int, default=2, help="rounds (default 2)")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--baseline", help="also mdtrain from this source tree (PYTHONPATH)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="float64", choices=["float64", "float32"])
    parser.add_argument("--deepmd-env", help="a virtual environment with DeePMD-kit's dp")
    parser.add_argument("--json", help="also write every run's figures to this file")
    parser.add_argument(
        "--ensemble", type=int, metavar="N",
        help="also each mdtrain variant with --ensemble N (a committee), and the committee's "
        "slope over the single model's, per round",
    )  # fmt: skip
    parser.add_argument(
        "--steady", type=int, metavar="N",
        help="also mdtrain on the systems cut to N frames each: the steady state's slope "
        "(with --paired-steps, any N: a trainer whose lists are all cached)",
    )  # fmt: skip
    parser.add_argument(
        "--paired-steps", type=int, metavar="N",
        help="instead: N first-epoch steps of a trainer per --prefetch value in one process, "
        "taken in turn (after 10 warm-up steps), float64, --threads threads",
    )  # fmt: skip
    args = parser.parse_args()
    if args.paired_steps:
        load = os.getloadavg()[0]
        res = paired_steps(
            os.path.join(os.path.abspath(args.data), "input.json"), args.paired_steps, 10,
            args.prefetch, args.threads, bool(args.steady),
        )  # fmt: skip
        print(f"{args.paired_steps} first-epoch steps in turn, load {load:.1f} / "
              f"{os.getloadavg()[0]:.1f} (medians and means, ms per step)")  # fmt: skip
        print("| nlist_prefetch | wall | process CPU | training thread CPU | its waits per step "
              "| lists built ahead |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- |")
        for depth, r in res.items():
            cells = [
                f"{r[k] * 1e3:.1f} (mean {r['mean_' + k] * 1e3:.1f})"
                for k in ("wall_s", "process_cpu_s", "thread_cpu_s")
            ]
            print(f"| {depth} | {' | '.join(cells)} | {r['thread_waits']:.1f} | "
                  f"{r['lists_built_ahead']} of "
                  f"{r['lists_built']} |")  # fmt: skip
        return
    base = os.path.abspath(args.data)
    with open(os.path.join(base, "input.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    env = thread_env(args.threads)
    mdtrain = [*mdtrain_command(), "train", "input.json"]
    # name -> (command, nlist_prefetch, environment, where the systems are)
    variants: dict[str, tuple[list[str], int | None, dict[str, str], str]] = {}
    if args.baseline:
        other = {**env, "PYTHONPATH": os.path.abspath(args.baseline)}
        variants[f"mdtrain from {args.baseline}"] = (mdtrain, -1, other, base)
    for p in args.prefetch:
        variants[f"mdtrain nlist_prefetch={p}"] = (mdtrain, p, env, base)
    if args.ensemble:
        for name, (command, prefetch, child_env, where) in list(variants.items()):
            committee = [*command, "--ensemble", str(args.ensemble)]
            variants[f"{name} --ensemble {args.ensemble}"] = (committee, prefetch, child_env, where)
    scratch = tempfile.TemporaryDirectory(prefix="first-epoch-steady-")
    if args.steady:
        cut = truncated_copy(config, base, args.steady, scratch.name)
        name = f"mdtrain nlist_prefetch={args.prefetch[0]}, steady ({args.steady} frames/system)"
        variants[name] = (mdtrain, args.prefetch[0], env, cut)
    if args.deepmd_env:
        dp = os.path.join(args.deepmd_env, "bin", "dp")
        variants["DeePMD-kit dp --pt train"] = (
            [dp, "--pt", "train", "input.json"],
            None,
            env,
            base,
        )
    n1, n2 = args.steps
    load = [os.getloadavg()[0]]
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.repeat):
        for name, (command, prefetch, child_env, where) in variants.items():  # alternating
            runs = {}
            for n in (n1, n2):
                given = run_input(config, where, n, args.precision, prefetch)
                runs[n] = one_run(command, given, child_env)
            slope = {k: (runs[n2][k] - runs[n1][k]) / (n2 - n1) for k in ("wall_s", "cpu_s")}
            rounds[name].append({"runs": {str(n): v for n, v in runs.items()}, "slope": slope})
            print(f"round {r + 1} {name}: {slope['wall_s'] * 1e3:.1f} ms/step wall, "
                  f"{slope['cpu_s'] * 1e3:.1f} ms/step CPU", file=sys.stderr, flush=True)  # fmt: skip
    load.append(os.getloadavg()[0])
    print(f"{base}: {args.precision}, {args.threads} thread(s), slope between {n1} and {n2} "
          f"steps, {args.repeat} alternating rounds, load average {load[0]:.1f} / {load[1]:.1f}")  # fmt: skip
    print("| variant | wall ms/step (range) | CPU ms/step (range) | whole run of "
          f"{n2} steps, wall s |")  # fmt: skip
    print("| --- | --- | --- | --- |")
    for name, res in rounds.items():
        cells = []
        for key in ("wall_s", "cpu_s"):
            values = [x["slope"][key] * 1e3 for x in res]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})")
        whole = statistics.median(x["runs"][str(n2)]["wall_s"] for x in res)
        print(f"| {name} | {cells[0]} | {cells[1]} | {whole:.1f} |")
    if args.ensemble:
        _print_committee_ratios(rounds, f" --ensemble {args.ensemble}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"load": load, "args": vars(args), "rounds": rounds}, handle, indent=1)
    scratch.cleanup()


def _print_committee_ratios(rounds: dict[str, list[dict]], suffix: str) -> None:
    """Per mdtrain variant: the committee's slope over the single model's, round by round."""
    print("| variant | committee / single, wall (rounds) | CPU (rounds) |")
    print("| --- | --- | --- |")
    for name, res in rounds.items():
        if name + suffix not in rounds:
            continue
        cells = []
        for key in ("wall_s", "cpu_s"):
            ratios = [c["slope"][key] / s["slope"][key] for s, c in zip(res, rounds[name + suffix])]
            each = ", ".join(f"{x:.2f}" for x in ratios)
            cells.append(f"{statistics.median(ratios):.2f}× ({each})")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
