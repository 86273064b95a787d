"""Gradient averaging over Gloo ranks on this machine: the all-reduce alone, and the training
step with and without the all-reduces overlapped with the backward.

    python benchmarks/allreduce.py comm examples/water [--ranks 2 3]
        [--models example dpwater fit1024] [--reps 40] [--bucket-mb 2] [--json out.json]
    python benchmarks/allreduce.py window examples/water [--models ...] [--reps 40]
    python benchmarks/allreduce.py step examples/water [--ranks 1 2 3] [--models example]
        [--steps 60] [--warmup 10] [--repeat 3] [--bucket-mb 2] [--json out.json]

The argument is an ``input.json`` or a directory holding one (its model and training data;
``stat_file`` and validation are ignored, nothing is written next to the data). Every rank
is a process of its own on this machine, connected over loopback TCP by Gloo, with one torch
thread (``OMP_NUM_THREADS=1``); more ranks than cores oversubscribe them (the processes
then share the cores and every time grows). Models, in float64:

- ``example``: the input's own model;
- ``dpwater``: DeePMD-kit's water example sizes (embedding 25-50-100, axis 16, two-sided;
  fitting 240-240-240) on the input's descriptor cut-offs;
- ``fit1024``: the input's model with a 1024-1024-1024 fitting net.

``comm``: the gradient's exact size (from the parameter count), then per model the median
(and minimum) wall time, and the median CPU time of the process, of one all-reduce of the whole gradient as one flat buffer, and of the
averaging the trainer does (``GradientBuckets.all_reduce``: copies in, one all-reduce per
bucket, average and copy out), each after a barrier; then a size sweep (8 B to 32 MiB) with
the latency and bandwidth of this loopback fitted to the medians
(``T = 2(N-1)·alpha + 2(N-1)/N · bytes / BW``).

``window``: one process, no communication: per model and training system (its first frame)
the forward and backward times, and when, counted from the backward's start, each bucket's
gradients are complete (what the overlap can hide behind: the rest of the backward).

``step``: the real training step (``Trainer.train_step``) on the input's data, every
training frame's neighbour list cached first, per rank count with overlap on and off (in
alternation, ``--repeat`` fresh launches each). Reported from rank 0: median wall time per
step (after warm-up) with the 10th/90th percentiles, the median process CPU time per step
(Gloo's threads included), and the median *tail*: from the end of the step's last
backward until the averages are in the gradients (the vote, then with overlap the wait for
what is still in flight, without it all the all-reduces; the copies). Other work on the
machine inflates the times: repeat, compare medians, and read the load average printed with
each row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from loopback import free_port, rank_env
from train_step import find_input

VARIANTS: dict[str, dict] = {
    "example": {},
    "dpwater": {
        "descriptor": {"neuron": [25, 50, 100], "axis_neuron": 16, "type_one_side": False},
        "fitting_net": {"neuron": [240, 240, 240]},
    },
    "fit1024": {"fitting_net": {"neuron": [1024, 1024, 1024]}},
}


def variant_config(input_path: str, name: str) -> dict:
    """The input's configuration with the model ``name``, float64, no validation, no files."""
    from mdtrain.config import load_config

    config = load_config(input_path)
    model = config["model"]
    for section, changes in VARIANTS[name].items():
        model[section].update(changes)
    for section in ("descriptor", "fitting_net"):
        model[section]["precision"] = "float64"
    config["training"].pop("validation_data", None)
    config["training"]["stat_file"] = None
    return config


def gradient_params(input_path: str, name: str) -> list:
    """The model's trainable parameters on the CPU (sel does not change their count)."""
    from mdtrain.model.backend import build_model

    config = variant_config(input_path, name)
    descriptor = config["model"]["descriptor"]
    if not isinstance(descriptor["sel"], list):
        descriptor["sel"] = [46, 92]  # any list: the parameters do not depend on it
    model = build_model(config["model"])
    return [p for p in model.parameters() if p.requires_grad]


# ---------------------------------------------------------------------------- children


def _timed(fn, reps: int) -> list[float]:
    """Median and minimum wall seconds of ``fn()`` over ``reps`` calls, each started together
    after a barrier (the minimum: the cost when nothing else ran on the machine), and the
    median CPU seconds of this process in it (Gloo's threads included)."""
    import torch.distributed as dist

    times, cpu = [], []
    for _ in range(reps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return [statistics.median(times), min(times), statistics.median(cpu)]


def child_comm(input_path: str, models: list[str], reps: int, bucket_mb: float) -> dict:
    import torch
    import torch.distributed as dist

    from mdtrain import distributed as dist_rt

    runtime = dist_rt.init_distributed("gloo", True, 300.0)
    torch.set_num_threads(1)
    world = runtime.world_size
    out: dict = {"world": world, "bucket_mb": bucket_mb, "models": {}, "sweep": []}
    with runtime:
        for name in models:
            params = gradient_params(input_path, name)
            for p in params:
                p.grad = torch.randn_like(p)
            count = sum(p.numel() for p in params)
            flat = torch.randn(count, dtype=torch.float64)
            buckets = dist_rt.GradientBuckets(params, bucket_mb)
            out["models"][name] = {
                "params": count,
                "bytes": count * 8,
                "buckets": len(buckets.buckets),
                "flat_s": _timed(lambda f=flat: dist.all_reduce(f), reps),
                "buckets_s": _timed(lambda b=buckets: b.all_reduce(world), reps),
            }
        for exponent in range(3, 27, 2):  # 8 B .. 64 MiB
            nbytes = 2**exponent
            buf = torch.zeros(max(nbytes // 8, 1), dtype=torch.float64)
            n = reps if nbytes <= 2**22 else max(5, reps // 4)
            median, least, cpu = _timed(lambda b=buf: dist.all_reduce(b), n)
            out["sweep"].append({"bytes": nbytes, "s": median, "min_s": least, "cpu_s": cpu})
    return out


def child_step(
    input_path: str, name: str, overlap: bool, bucket_mb: float, steps: int, warmup: int
) -> dict:
    import contextlib
    import tempfile

    import numpy as np
    import torch

    from mdtrain import distributed as dist_rt
    from mdtrain.batching import make_batch
    from mdtrain.memory import keep_freed_memory
    from mdtrain.model.backend import build_model
    from mdtrain.model.stats import compute_or_load_stats
    from mdtrain.train.loop import Trainer, seed_everything
    from mdtrain.train.prepare import open_datasets, resolve_model_sel

    config = variant_config(input_path, name)
    training = config["training"]
    training["numb_steps"] = warmup + steps
    training["disp_freq"] = training["save_freq"] = 10**9
    training["distributed"] = {"overlap_comm": overlap, "bucket_mb": bucket_mb}
    runtime = dist_rt.init_distributed("gloo", True, 300.0)
    torch.set_num_threads(1)
    with runtime:
        data = open_datasets(config, input_path)
        config = resolve_model_sel(config, input_path, data, None, skip_neighbor_stat=False)
        seed_everything(int(training.get("seed") or 0))
        keep_freed_memory()
        model = build_model(config["model"])
        compute_or_load_stats(model, data.train, None, 2)
        dist_rt.broadcast_module(model)
        with tempfile.TemporaryDirectory() as out_dir:
            trainer = Trainer(config, model, data.train, [], runtime, out_dir)
            d = config["model"]["descriptor"]
            for system in data.train:  # steady state: every frame's list cached
                for frame in range(system.nframes):
                    make_batch(system, [frame], d["rcut"], d["sel"], "cpu", trainer.nlist_cache)
            # the tail: from the end of the step's last backward to the averages in the
            # gradients (the vote, the all-reduces left to wait for, the copies)
            tails: list[float] = []
            backward_end = [0.0]
            buckets = trainer.grad_buckets
            if buckets is not None:
                communicating = trainer._communicating

                @contextlib.contextmanager
                def marked(last: bool, inner=communicating):
                    with inner(last):
                        yield
                    backward_end[0] = time.perf_counter()

                trainer._communicating = marked
                attr = "finish" if overlap else "all_reduce"
                averaging = getattr(buckets, attr)

                def timed(world: int, inner=averaging) -> None:
                    inner(world)
                    tails.append(time.perf_counter() - backward_end[0])

                setattr(buckets, attr, timed)
            model.train()
            wall = []
            load = os.getloadavg()[0]
            dist_rt.barrier()
            cpu = []
            for step in range(warmup + steps):
                t0, c0 = time.perf_counter(), time.process_time()
                trainer.train_step(trainer.lr.value(step))
                if step >= warmup:
                    wall.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
            load = (load, os.getloadavg()[0])
        nbytes = sum(p.numel() * p.element_size() for p in trainer.params)
    return {
        "model": name,
        "world": runtime.world_size,
        "overlap": overlap,
        "bucket_mb": bucket_mb,
        "buckets": 0 if buckets is None else len(buckets.buckets),
        "bytes": nbytes,
        "batch_size": training["training_data"]["batch_size"],
        "natoms": sorted({s.natoms for s in data.train}),
        "wall_s": statistics.median(wall),
        "wall_min_s": min(wall),
        "wall_p10_s": float(np.percentile(wall, 10)),
        "wall_p90_s": float(np.percentile(wall, 90)),
        "cpu_s": statistics.median(cpu),
        "tail_s": statistics.median(tails[warmup:]) if tails else 0.0,
        "load": [round(x, 2) for x in load],
    }


def child_window(input_path: str, name: str, bucket_mb: float, reps: int) -> dict:
    """One process, no group: forward and backward times of a training step's model and loss
    on each training system's first frame, and when (from the backward's start) each bucket's
    gradients are complete, buckets in the trainer's order."""
    import numpy as np
    import torch

    from mdtrain import distributed as dist_rt
    from mdtrain.batching import make_batch
    from mdtrain.model.backend import build_model
    from mdtrain.model.stats import compute_or_load_stats
    from mdtrain.train.loop import seed_everything
    from mdtrain.train.loss import EnergyLoss
    from mdtrain.train.prepare import open_datasets, resolve_model_sel

    torch.set_num_threads(1)
    config = variant_config(input_path, name)
    data = open_datasets(config, input_path)
    config = resolve_model_sel(config, input_path, data, None, skip_neighbor_stat=False)
    seed_everything(int(config["training"].get("seed") or 0))
    model = build_model(config["model"])
    compute_or_load_stats(model, data.train, None, 2)
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = dist_rt.GradientBuckets(params, bucket_mb)
    stamps: dict[int, float] = {}
    for k, p in enumerate(params):
        p.register_post_accumulate_grad_hook(
            lambda _, k=k: stamps.__setitem__(k, time.perf_counter())
        )
    index = {id(p): k for k, p in enumerate(params)}
    loss_fn = EnergyLoss.from_config(config["loss"], config["learning_rate"]["start_lr"])
    d = config["model"]["descriptor"]
    model.train()
    systems = []
    for system in data.train:
        batch = make_batch(system, [0], d["rcut"], d["sel"], "cpu", None)
        fwd, bwd, ready = [], [], []
        for _ in range(reps):
            model.zero_grad(set_to_none=True)
            stamps.clear()
            t0 = time.perf_counter()
            pred = model(*batch.inputs())
            loss, _ = loss_fn(pred, batch.labels, batch.natoms, 1e-3)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            ready.append([max(stamps[index[id(p)]] for p in b) - t1 for b in buckets.buckets])
        systems.append({
            "natoms": system.natoms,
            "forward_s": float(np.median(fwd)),
            "backward_s": float(np.median(bwd)),
            "ready_s": np.median(np.array(ready), axis=0).tolist(),
        })  # fmt: skip
    return {
        "model": name,
        "bucket_mb": bucket_mb,
        "bucket_bytes": [sum(p.numel() * p.element_size() for p in b) for b in buckets.buckets],
        "systems": systems,
    }


# ---------------------------------------------------------------------------- parent


def launch(world: int, child_args: list[str]) -> dict:
    """Run this script's child on ``world`` ranks (torchrun's variables, loopback); rank 0's
    JSON result, or exit with the failing rank's output."""
    import contextlib
    import tempfile

    port = str(free_port())
    procs, texts = [], []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        logs = []
        for rank in range(world):
            env = rank_env(rank, world, port)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", *child_args]
            out = stack.enter_context(open(os.path.join(tmp, f"out{rank}"), "w+"))
            err = stack.enter_context(open(os.path.join(tmp, f"err{rank}"), "w+"))
            logs.append((out, err))
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err))
        for p in procs:
            p.wait()
        for out, err in logs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
    for rank, (p, (_, err)) in enumerate(zip(procs, texts, strict=True)):
        if p.returncode != 0:
            tail = "\n".join(err.strip().splitlines()[-15:])
            sys.exit(f"rank {rank} of {world} failed (exit code {p.returncode}):\n{tail}")
    return json.loads(texts[0][0].strip().splitlines()[-1])


def fit_loopback(sweep: list[dict], world: int) -> dict:
    """alpha and BW of ``T = 2(N-1)·alpha + 2(N-1)/N · bytes / BW`` by least squares on the
    sweep (times weighted by 1/T, so that small and large messages count alike)."""
    import numpy as np

    x = np.array([e["bytes"] for e in sweep], dtype=float)
    t = np.array([e["s"] for e in sweep])
    a = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    (c0, c1), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    steps = 2 * (world - 1)
    return {"alpha_s": c0 / steps, "bandwidth_Bps": steps / world / c1}


def run_comm(args: argparse.Namespace, input_path: str) -> list[dict]:
    results, load = [], os.getloadavg()
    for world in args.ranks:
        child = ["comm", input_path, "--reps", str(args.reps), "--bucket-mb", str(args.bucket_mb)]
        result = launch(world, child + ["--models", *args.models])
        result["fit"] = fit_loopback(result["sweep"], world)
        results.append(result)
    cores = os.cpu_count()
    print(f"all-reduce alone, Gloo on loopback, {cores} cores, 1 thread per rank, "
          f"median of {args.reps} (after a barrier each), buckets of {args.bucket_mb} MiB")  # fmt: skip
    print(f"load average before/after: {load[0]:.1f}/{os.getloadavg()[0]:.1f}")
    print("ranks  model     params     bytes       buckets  one flat ms (min; cpu)     "
          "trainer's ms (min; cpu)")  # fmt: skip
    for r in results:
        for name, m in r["models"].items():
            flat, trainer = ([t * 1e3 for t in m[k]] for k in ("flat_s", "buckets_s"))
            print(f"{r['world']:5d}  {name:<8} {m['params']:9d}  {m['bytes']:10d}  "
                  f"{m['buckets']:7d}  {flat[0]:8.3f} ({flat[1]:7.3f}; {flat[2]:7.3f})  "
                  f"{trainer[0]:8.3f} ({trainer[1]:7.3f}; {trainer[2]:7.3f})")  # fmt: skip
    print("ranks  " + "  ".join(f"{e['bytes']:>9d}" for e in results[0]["sweep"]) + "  bytes")
    for r in results:
        for key, what in (("s", "median"), ("min_s", "min")):
            print(f"{r['world']:5d}  " + "  ".join(f"{e[key] * 1e3:9.3f}" for e in r["sweep"])
                  + f"  ms, {what}")  # fmt: skip
        print(f"       fit of the medians: alpha {r['fit']['alpha_s'] * 1e6:.1f} us, "
              f"BW {r['fit']['bandwidth_Bps'] / 1e9:.2f} GB/s")  # fmt: skip
    return results


def run_step(args: argparse.Namespace, input_path: str) -> list[dict]:
    results = []
    for name in args.models:
        for world in args.ranks:
            modes = [False] if world == 1 else [True, False]
            for _ in range(args.repeat):
                for overlap in modes:
                    child = [
                        "step", input_path, "--models", name, "--overlap", str(int(overlap)),
                        "--bucket-mb", str(args.bucket_mb), "--steps", str(args.steps),
                        "--warmup", str(args.warmup),
                    ]  # fmt: skip
                    results.append(launch(world, child))
                    r = results[-1]
                    print(f"{name:<8} ranks {world}  overlap {'on ' if overlap else 'off'}  "
                          f"buckets {r['buckets']:2d}  step {r['wall_s'] * 1e3:8.2f} ms "
                          f"(cpu {r['cpu_s'] * 1e3:.2f}) "
                          f"(p10 {r['wall_p10_s'] * 1e3:.2f}, p90 {r['wall_p90_s'] * 1e3:.2f}, "
                          f"min {r['wall_min_s'] * 1e3:.2f})  "
                          f"tail {r['tail_s'] * 1e3:7.3f} ms  "
                          f"load {r['load'][0]}/{r['load'][1]}", flush=True)  # fmt: skip
    print("medians over the repeats (ms):")
    print("model     ranks  overlap  step     min      cpu      tail")
    keys = sorted({(r["model"], r["world"], r["overlap"]) for r in results},
                  key=lambda k: (args.models.index(k[0]), k[1], not k[2]))  # fmt: skip
    for model, world, overlap in keys:
        rows = [
            r for r in results if (r["model"], r["world"], r["overlap"]) == (model, world, overlap)
        ]
        step = statistics.median(r["wall_s"] for r in rows) * 1e3
        least = min(r["wall_min_s"] for r in rows) * 1e3
        cpu = statistics.median(r["cpu_s"] for r in rows) * 1e3
        tail = statistics.median(r["tail_s"] for r in rows) * 1e3
        mode = "-" if world == 1 else ("on" if overlap else "off")
        print(
            f"{model:<8}  {world:5d}  {mode:<7}  {step:7.2f}  {least:7.2f}  {cpu:7.2f}  {tail:7.3f}"
        )
    return results


def run_window(args: argparse.Namespace, input_path: str) -> list[dict]:
    results = []
    for name in args.models:
        child = ["window", input_path, "--models", name, "--bucket-mb", str(args.bucket_mb),
                 "--reps", str(args.reps)]  # fmt: skip
        results.append(launch(1, child))
    print(f"one process, 1 thread, median of {args.reps}; bucket readiness from the backward's "
          f"start, buckets of {args.bucket_mb} MiB in the trainer's order (kB: its size)")  # fmt: skip
    for r in results:
        sizes = " ".join(f"{b / 1e3:.0f}" for b in r["bucket_bytes"])
        print(f"{r['model']}: bucket kB {sizes}")
        for s in r["systems"]:
            ready = " ".join(f"{t * 1e3:.1f}" for t in s["ready_s"])
            print(f"  {s['natoms']:4d} atoms: forward {s['forward_s'] * 1e3:.1f} ms, backward "
                  f"{s['backward_s'] * 1e3:.1f} ms, buckets ready at {ready} ms")  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["comm", "step", "window"])
    parser.add_argument("data", help="input.json, or a directory holding one")
    parser.add_argument("--ranks", type=int, nargs="+")
    parser.add_argument("--models", nargs="+", choices=list(VARIANTS))
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    parser.add_argument(
        "--reps", type=int, default=40, help="comm: all-reduces per size; window: backwards"
    )
    parser.add_argument("--steps", type=int, default=60, help="step: timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="step: steps before timing")
    parser.add_argument("--repeat", type=int, default=3, help="step: launches per setting")
    parser.add_argument("--overlap", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    input_path = find_input(args.data)
    if args.child:
        if args.what == "comm":
            result = child_comm(input_path, args.models, args.reps, args.bucket_mb)
        elif args.what == "window":
            result = child_window(input_path, args.models[0], args.bucket_mb, args.reps)
        else:
            result = child_step(
                input_path, args.models[0], bool(args.overlap), args.bucket_mb, args.steps,
                args.warmup,
            )  # fmt: skip
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return
    if args.what == "comm":
        args.ranks = args.ranks or [2, 3]
        args.models = args.models or list(VARIANTS)
        results = run_comm(args, input_path)
    elif args.what == "window":
        args.models = args.models or list(VARIANTS)
        results = run_window(args, input_path)
    else:
        args.ranks = args.ranks or [1, 2, 3]
        args.models = args.models or ["example"]
        results = run_step(args, input_path)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
