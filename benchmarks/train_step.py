"""Time the real training loop (``Trainer.train_step``: batch and neighbour lists, forward,
forces, loss, backward, Adam) on a data set given by its input file.

    python benchmarks/train_step.py /path/to/water-dft [--steps 300] [--warmup 30]
        [--precision float64 float32] [--threads 2] [--batch-size N] [--uncached]
        [--ensemble 1 4] [--repeat 3] [--profile] [--json result.json]

The argument is an ``input.json`` or a directory holding one; its systems are resolved
relative to it. Nothing is written next to the data: the statistics are computed in memory
(``stat_file`` is ignored), outputs go to a temporary directory, and validation, display and
checkpoints are off during the timing; ``--batch-size`` replaces the input's training batch
size. Each precision runs in a fresh process (clean allocator state and its own peak RSS)
with ``OMP_NUM_THREADS`` set to the thread count. The trainer's neighbour-list cache is
filled with every training frame first (the steady state of a run longer than an epoch; the
time of a batch built from scratch is reported too); with ``--uncached`` the cache is off and
every step builds its neighbour lists, as in a first epoch and as DeePMD-kit does at every
step. Reported per precision: median (and
mean) wall and median process CPU time per step (after warm-up) with the 10th/90th wall
percentiles, the median time of the batch preparation inside the step (frames and
neighbour lists), the peak RSS, and the load average of the machine around the run
(others' work inflates the times).

``--ensemble 1 4`` times a single model and a committee of 4 (``mdtrain train --ensemble 4``:
one joint step of every member on the same batch, ``mdtrain.train.loop``) side by side:
each round runs every size once, in fresh processes, alternating, and the table gives each
committee's median step time over the rounds and its ratio to the single model's median of
the same round (``--repeat`` rounds). With ``--paired`` every size is built in one process
and their steps are taken in turn, each committee step divided by the single step just
before it (the same batch, the same moment's load); the medians of these ratios are the
figure least disturbed by other work on the machine. ``--profile`` adds the torch profiler's
table of the operations that took the most time over the timed steps (printed, and in the
JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def _prepared(
    input_path: str,
    precision: str,
    steps: int,
    warmup: int,
    threads: int,
    batch_size: int | None,
):
    """The input (precision, step count, no display or checkpoints), its data and sel, and a
    runtime of one rank, as ``mdtrain train`` sets them up."""
    import torch

    from mdtrain import distributed as dist_rt
    from mdtrain.config import load_config
    from mdtrain.memory import keep_freed_memory
    from mdtrain.train.loop import seed_everything
    from mdtrain.train.prepare import open_datasets, resolve_model_sel

    config = load_config(input_path)
    model_cfg = config["model"]
    for section in ("descriptor", "fitting_net"):
        model_cfg[section]["precision"] = precision
    training = config["training"]
    training["numb_steps"] = warmup + steps
    training["disp_freq"] = training["save_freq"] = 10**9
    if batch_size is not None:
        training["training_data"]["batch_size"] = batch_size
    data = open_datasets(config, input_path)
    config = resolve_model_sel(config, input_path, data, None, skip_neighbor_stat=False)
    config["training"]["seed"] = int(config["training"].get("seed") or 0)
    seed_everything(config["training"]["seed"])
    torch.set_num_threads(threads)
    keep_freed_memory()  # as mdtrain train does
    runtime = dist_rt.init_distributed("gloo", True, 60.0)
    torch.set_num_threads(threads)  # after init_distributed, which sets one per usable core
    return config, data, runtime


def _trainer(config: dict, data, runtime, size: int, out_dir: str, uncached: bool):
    """The Trainer of one model (size 1) or a committee (``mdtrain train --ensemble size``) with
    the statistics computed in memory, validation off, its batch preparation timed, and its
    neighbour-list cache filled with every training frame (unless ``uncached``). Returns the
    trainer, the times of its batches and of the uncached batches made to fill the cache."""
    import time

    from mdtrain.batching import make_batch
    from mdtrain.model.backend import build_models
    from mdtrain.model.committee import members_of, share_statistics
    from mdtrain.model.stats import compute_or_load_stats
    from mdtrain.train.committee import SHARED, member_config
    from mdtrain.train.loop import Trainer

    members = [member_config(config, k, SHARED) for k in range(size)]
    model = build_models([m["model"] for m in members])
    models = members_of(model)
    nbatch = int(config["model"].get("data_stat_nbatch", 10))
    compute_or_load_stats(models[0], data.train, None, nbatch)
    share_statistics(models)  # computed once, as mdtrain train does
    trainer = Trainer(config, model, data.train, data.valid, runtime, out_dir)
    for member in trainer.members:
        member.valid_sampler = None  # no validation inside the timing
    batch_times: list[float] = []
    make = trainer._batch

    def timed_batch(*args, **kwargs):
        t0 = time.perf_counter()
        batch = make(*args, **kwargs)
        batch_times.append(time.perf_counter() - t0)
        return batch

    trainer._batch = timed_batch
    if uncached:
        trainer.nlist_cache = None
        trainer.prefetch = None  # every list built in the step, as before lists were built ahead
    cache = getattr(trainer, "nlist_cache", None)
    fresh_times: list[float] = []
    if cache is not None:
        # steady state of a long run: every training frame has been drawn before
        # the trainer's own lists (a type-mixed or hybrid descriptor's layout and sel)
        rcut, sel, layout = trainer.lists
        for system in data.train:
            for frame in range(system.nframes):
                t0 = time.perf_counter()
                make_batch(system, [frame], rcut, sel, "cpu", cache, layout, trainer.param_spec)
                fresh_times.append(time.perf_counter() - t0)
    model.train()
    return trainer, batch_times, fresh_times


def measure(
    input_path: str,
    precision: str,
    steps: int,
    warmup: int,
    threads: int,
    batch_size: int | None = None,
    uncached: bool = False,
    ensemble: int = 1,
    profile: bool = False,
) -> dict:
    """Run in the child process: set up a Trainer (or a committee's) like ``mdtrain train``
    does, then time it."""
    import resource
    import time

    import numpy as np
    import torch

    config, data, runtime = _prepared(input_path, precision, steps, warmup, threads, batch_size)
    training = config["training"]
    with tempfile.TemporaryDirectory() as out_dir:
        trainer, batch_times, fresh_times = _trainer(
            config, data, runtime, ensemble, out_dir, uncached
        )
        wall, cpu = [], []
        load_before = os.getloadavg()[0]
        profiler = None
        for step in range(warmup + steps):
            if profile and step == warmup:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
            lr = trainer.lr.value(step)
            w0, c0 = time.perf_counter(), time.process_time()
            trainer.train_step(lr)
            if step >= warmup:
                wall.append(time.perf_counter() - w0)
                cpu.append(time.process_time() - c0)
        load_after = os.getloadavg()[0]
        table = None
        if profiler is not None:
            profiler.__exit__(None, None, None)
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            print(table, file=sys.stderr)
    natoms = sorted({s.natoms for s in data.train})
    return {
        "precision": precision,
        "threads": threads,
        "steps": steps,
        "warmup": warmup,
        "natoms": natoms,
        "sel": list(trainer.lists[1]),
        "batch_size": training["training_data"]["batch_size"],
        "uncached": uncached,
        "ensemble": ensemble,
        "wall_s_per_step": statistics.median(wall),
        "wall_mean_s": statistics.fmean(wall),
        "wall_p10_s": float(np.percentile(wall, 10)),
        "wall_p90_s": float(np.percentile(wall, 90)),
        "cpu_s_per_step": statistics.median(cpu),
        "batch_s_per_step": statistics.median(batch_times[warmup:]),
        "batch_uncached_s": statistics.median(fresh_times) if fresh_times else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "torch": torch.__version__,
        "profile": table,
    }


def measure_paired(
    input_path: str,
    precision: str,
    steps: int,
    warmup: int,
    threads: int,
    batch_size: int | None,
    uncached: bool,
    sizes: list[int],
) -> dict:
    """Run in the child process: trainers of every size in one process, their steps taken in
    turn (the same batch for each: they share the sampler seed), each step's time divided by
    the single model's step just before it. On a machine shared with other work this pairs
    every committee step with a single step taken under the same load."""
    import time

    import torch

    config, data, runtime = _prepared(input_path, precision, steps, warmup, threads, batch_size)
    sizes = [1, *[s for s in sizes if s != 1]]
    times: dict[int, list[tuple[float, float]]] = {s: [] for s in sizes}
    with tempfile.TemporaryDirectory() as out_dir:
        trainers = [
            _trainer(config, data, runtime, s, os.path.join(out_dir, str(s)), uncached)[0]
            for s in sizes
        ]
        load_before = os.getloadavg()[0]
        for step in range(warmup + steps):
            lr = trainers[0].lr.value(step)
            for size, trainer in zip(sizes, trainers, strict=True):
                w0, c0 = time.perf_counter(), time.process_time()
                trainer.train_step(lr)
                if step >= warmup:
                    times[size].append((time.perf_counter() - w0, time.process_time() - c0))
        load_after = os.getloadavg()[0]
    single = times[1]
    out = {
        "precision": precision,
        "threads": threads,
        "steps": steps,
        "uncached": uncached,
        "paired": True,
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "torch": torch.__version__,
        "sizes": {},
    }
    for size in sizes:
        runs = times[size]
        out["sizes"][str(size)] = {
            "wall_s_per_step": statistics.median(w for w, _ in runs),
            "cpu_s_per_step": statistics.median(c for _, c in runs),
            "paired_wall_ratio": statistics.median(a[0] / b[0] for a, b in zip(runs, single)),
            "paired_cpu_ratio": statistics.median(a[1] / b[1] for a, b in zip(runs, single)),
        }
    return out


def find_input(path: str) -> str:
    """The absolute path of ``path`` (an input file, or a directory holding input.json)."""
    if os.path.isdir(path):
        path = os.path.join(path, "input.json")
    if not os.path.isfile(path):
        sys.exit(f"{path}: no such input file")
    return os.path.abspath(path)


def run_measure(
    input_path: str,
    precision: str,
    steps: int,
    warmup: int,
    threads: int,
    batch_size: int | None = None,
    uncached: bool = False,
    ensemble: int | list[int] = 1,
    profile: bool = False,
) -> dict:
    """`measure` (or, for a list of sizes, `measure_paired`) in a fresh process of this
    interpreter; its result, or RuntimeError with the end of the child's output."""
    cmd = [sys.executable, os.path.abspath(__file__), input_path, "--child", precision]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    if batch_size is not None:
        cmd += ["--batch-size", str(batch_size)]
    if uncached:
        cmd.append("--uncached")
    paired = isinstance(ensemble, list)
    cmd += ["--ensemble", *map(str, ensemble if paired else [ensemble])]
    cmd += (["--paired"] if paired else []) + (["--profile"] if profile else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if profile:
        print(done.stderr, file=sys.stderr)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"exit code {done.returncode}: {' '.join(cmd)}\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="input.json, or a directory holding one")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--precision", nargs="+", choices=["float64", "float32"], default=["float64", "float32"]
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--batch-size", type=int, help="training batch size (default: input's)")
    parser.add_argument(
        "--uncached", action="store_true", help="no neighbour-list cache (a first epoch)"
    )
    parser.add_argument(
        "--ensemble", type=int, nargs="+", default=[1],
        help="committee sizes to time side by side (1: a single model; default 1)",
    )  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the sizes (default 1)")
    parser.add_argument(
        "--paired", action="store_true",
        help="time the sizes in one process, their steps in turn, each against the single "
        "model's step just before it (robust on a busy machine)",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="print the torch profiler table")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    input_path = find_input(args.data)
    if args.child and args.paired:
        result = measure_paired(
            input_path, args.child, args.steps, args.warmup, args.threads, args.batch_size,
            args.uncached, args.ensemble,
        )  # fmt: skip
        print(json.dumps(result))
        return
    if args.child:
        result = measure(
            input_path, args.child, args.steps, args.warmup, args.threads, args.batch_size,
            args.uncached, args.ensemble[0], args.profile,
        )  # fmt: skip
        print(json.dumps(result))
        return
    if args.paired:
        paired_main(args, input_path)
        return
    results = []
    try:
        for _ in range(args.repeat):
            for precision in args.precision:
                for size in args.ensemble:  # alternating: every size sees the same load
                    results.append(
                        run_measure(input_path, precision, args.steps, args.warmup, args.threads,
                                    args.batch_size, args.uncached, size, args.profile)
                    )  # fmt: skip
    except RuntimeError as exc:
        sys.exit(f"the timing process failed, {exc}")
    print(f"{input_path}: {results[0]['natoms']} atoms, sel {results[0]['sel']}, "
          f"{args.threads} thread(s), {args.steps} steps after {args.warmup} warm-up, "
          f"{'uncached' if args.uncached else 'cached'} neighbour lists, "
          f"torch {results[0]['torch']}")  # fmt: skip
    header = (
        "precision  models  wall s/step  (p10 - p90)        cpu s/step  batch s/step"
        "  (uncached)  peak RSS MB  load"
    )
    print(header)
    for r in results:
        print(
            f"{r['precision']:<9}  {r['ensemble']:6d}  {r['wall_s_per_step']:11.4f}  "
            f"({r['wall_p10_s']:.4f} - {r['wall_p90_s']:.4f})  {r['cpu_s_per_step']:10.4f}  "
            f"{r['batch_s_per_step']:12.4f}  "
            f"{r['batch_uncached_s'] or float('nan'):10.4f}  {r['peak_rss_mb']:11.0f}  "
            f"{r['load_average'][0]:.1f}/{r['load_average'][1]:.1f}"
        )
    for line in ratios(results):
        print(line)
    print(json.dumps([{k: v for k, v in r.items() if k != "profile"} for r in results]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


def paired_main(args: argparse.Namespace, input_path: str) -> None:
    """``--paired``: one child per precision and round, every size timed in it."""
    results = []
    try:
        for _ in range(args.repeat):
            for precision in args.precision:
                results.append(
                    run_measure(input_path, precision, args.steps, args.warmup, args.threads,
                                args.batch_size, args.uncached, list(args.ensemble))
                )  # fmt: skip
    except RuntimeError as exc:
        sys.exit(f"the timing process failed, {exc}")
    print(f"{input_path}: {args.threads} thread(s), {args.steps} steps after {args.warmup} "
          f"warm-up, {'uncached' if args.uncached else 'cached'} neighbour lists, sizes taken "
          f"in turn in one process")  # fmt: skip
    print("precision  models  wall s/step  cpu s/step  paired ratio wall  cpu  load")
    for r in results:
        for size, f in r["sizes"].items():
            print(
                f"{r['precision']:<9}  {size:>6}  {f['wall_s_per_step']:11.4f}  "
                f"{f['cpu_s_per_step']:10.4f}  {f['paired_wall_ratio']:17.2f}  "
                f"{f['paired_cpu_ratio']:4.2f}  "
                f"{r['load_average'][0]:.1f}/{r['load_average'][1]:.1f}"
            )
    for precision in args.precision:
        mine = [r for r in results if r["precision"] == precision]
        for size in mine[0]["sizes"]:
            if size == "1":
                continue
            wall = statistics.median(r["sizes"][size]["paired_wall_ratio"] for r in mine)
            cpu = statistics.median(r["sizes"][size]["paired_cpu_ratio"] for r in mine)
            print(
                f"{precision} committee of {size}: {wall:.2f}x the single model's step "
                f"(CPU time {cpu:.2f}x), median over {len(mine)} round(s) of the paired ratios"
            )
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


def ratios(results: list[dict]) -> list[str]:
    """Per precision and committee size: the median step time over the rounds and the median
    of each round's ratio to the single model's step (wall and process CPU time)."""
    lines = []
    rounds: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        rounds.setdefault((r["precision"], r["ensemble"]), []).append(r)
    for (precision, size), runs in rounds.items():
        single = rounds.get((precision, 1))
        if size == 1 or not single:
            continue
        pairs = list(zip(runs, single, strict=False))
        wall = statistics.median(a["wall_s_per_step"] / b["wall_s_per_step"] for a, b in pairs)
        cpu = statistics.median(a["cpu_s_per_step"] / b["cpu_s_per_step"] for a, b in pairs)
        mine = statistics.median(a["wall_s_per_step"] for a in runs)
        alone = statistics.median(b["wall_s_per_step"] for b in single)
        lines.append(
            f"{precision} committee of {size}: median {mine:.4f} s/step against {alone:.4f}: "
            f"{wall:.2f}x the single model's step (CPU time {cpu:.2f}x), median of "
            f"{len(pairs)} round(s)"
        )
    return lines


if __name__ == "__main__":
    main()
