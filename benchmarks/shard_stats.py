"""The statistics stage on 1..N Gloo ranks of this machine: computed by rank 0 (``stat_mode:
"rank0"``, what one rank costs whatever N is) against split over the ranks (``"shard"``).

    python benchmarks/shard_stats.py DATA --type-map Al Cu Ni [--rcut 6.0] [--sel 60 60 60]
        [--nbatch 10] [--ranks 1 2 3] [--repeat 3] [--json out.json]

``DATA`` is a ``systems`` entry (a folder of deepmd/npy systems, an HDF5 file, one system), for
example what ``benchmarks/make_dataset.py`` writes. Each rank is a process of its own with one
thread (``OMP_NUM_THREADS=1``, so the neighbour search is single-threaded too), connected over
loopback TCP. Per rank count and launch, from rank 0, after a barrier: the neighbour
statistics of every frame (``neighbor_figures``), then the descriptor statistics and energy
bias of ``--nbatch`` batches per system (``model_statistics``, a small se_e2_a model with
``--sel``), each ended by a barrier. One rank runs "rank0"; more ranks run "shard". Reported:
the median wall time of each stage over ``--repeat`` launches, the speed-up over one rank, and
rank 0's own CPU time in the stage (its share of the work, which contention does not hide).
More ranks than cores oversubscribe them, and other work on the machine inflates the times:
read the load average printed with each row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from loopback import free_port, rank_env


def model_config(type_map: list[str], rcut: float, sel: list[int]) -> dict:
    return {
        "type_map": type_map,
        "descriptor": {
            "type": "se_e2_a",
            "sel": sel,
            "rcut": rcut,
            "rcut_smth": rcut - 1.0,
            "neuron": [8, 16],
            "axis_neuron": 4,
            "seed": 1,
        },
        "fitting_net": {"neuron": [16, 16], "seed": 1},
    }


def child(args: argparse.Namespace) -> None:
    """One rank: both stages, timed between barriers; rank 0 prints a JSON line."""
    from mdtrain import distributed as D
    from mdtrain.data import expand_systems, open_system
    from mdtrain.model.backend import build_model
    from mdtrain.train.prepare import model_statistics, neighbor_figures

    with D.init_distributed("gloo", timeout_s=3600) as rt:
        mode = "shard" if rt.world_size > 1 else "rank0"
        systems = [open_system(p, args.type_map) for p in expand_systems([args.data], ".")]
        config = model_config(args.type_map, args.rcut, args.sel)
        model = build_model(config, rt.device)
        D.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        min_dist, max_size = neighbor_figures(systems, args.rcut, len(args.type_map), mode)
        cpu_middle = time.process_time()
        D.barrier()
        middle = time.perf_counter()
        model_statistics(model, systems, None, args.nbatch, mode)
        cpu_end = time.process_time()
        D.barrier()
        end = time.perf_counter()
        if rt.rank == 0:
            result = {
                "ranks": rt.world_size,
                "mode": mode,
                "neighbor_s": middle - start,
                "model_s": end - middle,
                "neighbor_cpu_s": cpu_middle - cpu_start,  # rank 0's own work, before the wait
                "model_cpu_s": cpu_end - cpu_middle,
                "min_dist": min_dist,
                "max_size": max_size,
                "bias": model.out_bias.tolist(),
                "frames": sum(int(s.nframes) for s in systems),
                "systems": len(systems),
            }
            print(json.dumps(result), flush=True)


def launch(world: int, child_args: list[str]) -> dict:
    """This script's child on ``world`` ranks (torchrun's variables, loopback); rank 0's JSON
    line, or exit with the failing rank's last lines."""
    port = str(free_port())
    procs, files = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rank in range(world):
            env = rank_env(rank, world, port)
            out = open(os.path.join(tmp, f"out{rank}"), "w+")  # noqa: SIM115
            files.append(out)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", *child_args]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        for proc in procs:
            proc.wait()
        texts = []
        for out in files:
            out.seek(0)
            texts.append(out.read())
            out.close()
    for rank, (proc, text) in enumerate(zip(procs, texts, strict=True)):
        if proc.returncode != 0:
            tail = "\n".join(text.strip().splitlines()[-15:])
            sys.exit(f"rank {rank} of {world} failed (exit code {proc.returncode}):\n{tail}")
    lines = [line for line in texts[0].splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data")
    parser.add_argument("--type-map", nargs="+", required=True)
    parser.add_argument("--rcut", type=float, default=6.0)
    parser.add_argument("--sel", type=int, nargs="+", default=None, help="default: 60 per type")
    parser.add_argument("--nbatch", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sel = args.sel or [60] * len(args.type_map)
    if args.child:
        child(args)
        return
    child_args = [
        os.path.abspath(args.data), "--type-map", *args.type_map, "--rcut", str(args.rcut),
        "--sel", *map(str, args.sel), "--nbatch", str(args.nbatch),
    ]  # fmt: skip
    rows, base = [], None
    for world in args.ranks:
        runs = [launch(world, child_args) for _ in range(args.repeat)]
        row = dict(runs[0])
        for key in ("neighbor_s", "model_s", "neighbor_cpu_s", "model_cpu_s"):
            row[key] = statistics.median(r[key] for r in runs)
        row["load_avg"] = os.getloadavg()[0]
        base = base or row
        print(
            f"{world} rank(s) {row['mode']:5s}: neighbour statistics {row['neighbor_s']:.2f} s "
            f"(x{base['neighbor_s'] / row['neighbor_s']:.2f}; rank 0 CPU "
            f"{row['neighbor_cpu_s']:.2f} s), model statistics {row['model_s']:.2f} s "
            f"(x{base['model_s'] / row['model_s']:.2f}; rank 0 CPU {row['model_cpu_s']:.2f} s); "
            f"{row['frames']} frames, {row['systems']} systems; min distance "
            f"{row['min_dist']:.6f}, max neighbours {row['max_size']}; load {row['load_avg']:.1f}",
            flush=True,
        )
        rows.append(row)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
