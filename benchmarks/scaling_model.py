"""The scaling model of docs/distributed.md ("Scaling model"): predicted step time of
data-parallel training on N ranks from measured quantities, and its check against this
machine's loopback measurements.

    python benchmarks/scaling_model.py table [--network 10GbE 25GbE 100GbE IB-HDR]
        [--nodes 1 2 4 8 16 32 64 100] [--tc-ms MODEL=MS ...]
    python benchmarks/scaling_model.py check --window window.json --comm comm.json
        --step step_example.json [step_dpwater.json ...]

The model of one step on N ranks (ring all-reduce, one rank per node):

    T_ar(S, N)  = 2(N-1)·alpha + 2(N-1)/N · S / BW          one bucket of S bytes
    T_step(N)   = T_c + T_copy + T_comm + T_ar(4 B, N)       the last term: the step's vote
    T_comm      = sum_j T_ar(S_j, N)                          overlap off
    T_comm      = max(0, e_last - T_bwd)                      overlap on, with
    e_j         = max(r_j, e_{j-1}) + T_ar(S_j, N)            bucket j sent once ready (r_j)
                                                              and once bucket j-1 is through

``T_c`` is one rank's compute time per step (forward, backward, Adam, batch), ``T_bwd`` its
backward, ``r_j`` the time into the backward at which bucket j's gradients are complete
(``benchmarks/allreduce.py window``) and ``T_copy`` the copies into and out of the buckets
(3 passes over the gradient: 10 GB/s on CPU nodes, 1 TB/s on GPUs, or ``--copy-gbs``). The overlap term assumes the network moves
the bytes without the compute's cores (true of NCCL and RDMA; of TCP when a core is free).

``table``: the gradient sizes of the three models of ``benchmarks/allreduce.py``, then per
network the all-reduce time of each whole gradient and the predicted step time, overlap on
and off, for each node count. The networks' alpha and BW are typical values, not measured
here (no network here); the compute times default to the figures measured on this machine
(see ``MODELS``), and the GPU network to an assumed ``T_c``. ``check``: the same model with
this machine's loopback alpha and BW (fitted by ``allreduce.py comm``), its ``T_c`` from the
one-rank step and its bucket readiness from ``window``, against the measured 2- and 3-rank
steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass


@dataclass
class Network:
    name: str
    alpha_s: float  # per ring step: latency of one message
    bw_Bps: float  # achieved bytes/s of one rank's link
    note: str
    copy_Bps: float = 10e9  # memory copies into and out of the buckets (CPU memory)


# Typical values, assumed (not measured here: this machine has no network).
NETWORKS = {
    "10GbE": Network("10GbE", 30e-6, 1.1e9, "Gloo over TCP, 10 Gb/s Ethernet"),
    "25GbE": Network("25GbE", 25e-6, 2.8e9, "Gloo over TCP, 25 Gb/s Ethernet"),
    "100GbE": Network(
        "100GbE", 20e-6, 5.0e9, "Gloo over TCP, 100 Gb/s Ethernet (one TCP stream per peer)"
    ),
    "IB-HDR": Network(
        "IB-HDR", 10e-6, 20e9, "NCCL over 200 Gb/s HDR InfiniBand, GPU nodes", 1000e9
    ),
}


@dataclass
class Model:
    name: str
    params: int  # trainable parameters (float64: 8 bytes each)
    buckets_kb: list[float]  # bucket sizes at bucket_mb 2, in launch order (kB = 1000 B)
    ready: list[float]  # bucket j complete at ready[j] * T_bwd into the backward
    tc_ms: float  # one rank's step, 1 thread, this machine (CPU time, see the docs)
    bwd_ms: float  # its backward


# Measured on this machine (benchmarks/allreduce.py window and step, float64, 1 thread; run
# "B" of docs/distributed.md): T_c the one-rank CPU time per step (the water example's
# sampler: 80 % frames of 96 atoms, 20 % of 192), the backward's share of forward +
# backward and the bucket readiness from `window`. Bucket sizes from the parameters.
MODELS = {
    "example": Model("example", 55_682, [445.456], [1.0], 16.9, 0.495 * 16.9),
    "dpwater": Model(
        "dpwater",
        1_027_082,
        [933.1, 3072.0, 933.1, 3072.0, 206.4],
        [0.36, 0.36, 0.53, 0.53, 1.0],
        52.6,
        0.592 * 52.6,
    ),  # fmt: skip
    "fit1024": Model(
        "fit1024",
        4_864_114,
        [24.6, 8388.6, 16.4, 8388.6, 8.2, 2621.4, 24.6, 8388.6, 16.4, 8388.6, 8.2, 2621.4, 17.3],
        [0.58] * 6 + [0.93] * 6 + [1.0],
        109.7,
        0.667 * 109.7,
    ),  # fmt: skip
}
GPU_TC_MS = 10.0  # assumed GPU step time for every model (not measured: no GPU here)
GPU_BWD_SHARE = 0.5  # assumed: the backward is half of it


def allreduce_s(nbytes: float, n: int, net: Network) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * net.alpha_s + 2 * (n - 1) / n * nbytes / net.bw_Bps


def step_s(
    tc_s: float,
    bwd_s: float,
    buckets: list[tuple[float, float]],
    n: int,
    net: Network,
    overlap: bool,
    copy_Bps: float,
) -> float:
    """Predicted step time; ``buckets``: (bytes, ready time into the backward) in order."""
    if n <= 1:
        return tc_s
    total = sum(b for b, _ in buckets)
    copies = 3 * total / copy_Bps
    if not overlap:
        comm = sum(allreduce_s(b, n, net) for b, _ in buckets)
    else:
        end = 0.0
        for nbytes, ready in buckets:
            end = max(ready, end) + allreduce_s(nbytes, n, net)
        comm = max(0.0, end - bwd_s)
    return tc_s + copies + comm + allreduce_s(4, n, net)


def model_buckets(model: Model, bwd_s: float) -> list[tuple[float, float]]:
    return [(kb * 1e3, r * bwd_s) for kb, r in zip(model.buckets_kb, model.ready, strict=True)]


def run_table(args: argparse.Namespace) -> None:
    print("gradient per model (float64): params, bytes, MiB, buckets of 2 MiB")
    for m in MODELS.values():
        print(f"  {m.name:<8} {m.params:9d}  {m.params * 8:10d} B  {m.params * 8 / 2**20:6.2f} "
              f"MiB  {len(m.buckets_kb)} buckets")  # fmt: skip
    tc = dict(item.split("=") for item in args.tc_ms or [])
    for key in args.network:
        net = NETWORKS[key]
        gpu = key == "IB-HDR"
        copy_Bps = args.copy_gbs * 1e9 if args.copy_gbs else net.copy_Bps
        print(f"\n{net.note}: alpha {net.alpha_s * 1e6:.0f} us, BW {net.bw_Bps / 1e9:.1f} GB/s "
              "(assumed)")  # fmt: skip
        print("  all-reduce of the whole gradient, ms:")
        print("    model    " + "".join(f"{n:>9d}" for n in args.nodes))
        for m in MODELS.values():
            row = "".join(f"{allreduce_s(m.params * 8, n, net) * 1e3:9.2f}" for n in args.nodes)
            print(f"    {m.name:<8} {row}")
        print("  step ms, overlap on / off (efficiency T_c / T_step with overlap):")
        for m in MODELS.values():
            t_c = float(tc.get(m.name, GPU_TC_MS if gpu else m.tc_ms)) / 1e3
            bwd = t_c * (GPU_BWD_SHARE if gpu else m.bwd_ms / m.tc_ms)
            cells = []
            for n in args.nodes:
                on = step_s(t_c, bwd, model_buckets(m, bwd), n, net, True, copy_Bps)
                off = step_s(t_c, bwd, model_buckets(m, bwd), n, net, False, copy_Bps)
                cells.append(f"{on * 1e3:.1f}/{off * 1e3:.1f} ({t_c / on:.0%})")
            print(f"    {m.name:<8} T_c {t_c * 1e3:.0f} ms: " + "  ".join(cells))


def run_check(args: argparse.Namespace) -> None:
    windows = {}
    for path in args.window:
        with open(path, encoding="utf-8") as fh:
            windows.update({(r["model"], r["bucket_mb"]): r for r in json.load(fh)})
    with open(args.comm, encoding="utf-8") as fh:
        comm = {r["world"]: r for r in json.load(fh)}
    steps = []
    for path in args.step:
        with open(path, encoding="utf-8") as fh:
            steps += json.load(fh)
    print("loopback check. Prediction: T_c = the one-rank CPU time per step (times N/cores when "
          "the ranks oversubscribe the cores), readiness from `window`, the loopback alpha/BW "
          "fitted by `comm`. Measured: median over launches of each launch's median step "
          "(and the smallest step seen); CPU: per step and rank, predicted as T_c plus the "
          "CPU time of the trainer's averaging alone (`comm`); tail: from the end of the "
          "last backward to the averaged gradients.")  # fmt: skip
    print("model     MiB/bucket  ranks  overlap  wall pred  wall meas (min)   cpu pred  "
          "cpu meas  tail pred  tail meas")  # fmt: skip
    for name in dict.fromkeys(r["model"] for r in steps):
        rows = [r for r in steps if r["model"] == name]
        one = [r for r in rows if r["world"] == 1]
        if not one:
            continue
        tc1 = statistics.median(r["cpu_s"] for r in one)
        for bucket_mb in sorted({r["bucket_mb"] for r in rows if r["world"] > 1}):
            w = windows.get((name, bucket_mb))
            if w is None:
                continue
            systems = w["systems"]
            share = statistics.fmean(
                s["backward_s"] / (s["forward_s"] + s["backward_s"]) for s in systems
            )
            ready = [
                statistics.fmean(s["ready_s"][j] / s["backward_s"] for s in systems)
                for j in range(len(w["bucket_bytes"]))
            ]
            worlds = sorted({r["world"] for r in rows})
            for world in worlds:
                for overlap in (True, False) if world > 1 else (False,):
                    sel = [
                        r
                        for r in rows
                        if r["world"] == world
                        and r["overlap"] == overlap
                        and (world == 1 or r["bucket_mb"] == bucket_mb)
                    ]
                    if not sel:
                        continue
                    t_c = tc1 * max(1.0, world / args.cores)  # oversubscribed cores
                    bwd = t_c * share
                    buckets = [(b, r * bwd) for b, r in zip(w["bucket_bytes"], ready, strict=True)]
                    cpu_pred, tail = tc1, 0.0
                    if world > 1:
                        fit = comm[world]["fit"]
                        net = Network("loopback", fit["alpha_s"], fit["bandwidth_Bps"], "")
                        wall = step_s(t_c, bwd, buckets, world, net, overlap, args.copy_gbs * 1e9)
                        tail = wall - t_c
                        if bucket_mb == comm[world].get("bucket_mb", 2.0):
                            cpu_pred = tc1 + comm[world]["models"][name]["buckets_s"][2]
                        else:
                            cpu_pred = float("nan")
                    else:
                        wall = t_c
                    med = statistics.median(r["wall_s"] for r in sel) * 1e3
                    least = min(r["wall_min_s"] for r in sel) * 1e3
                    cpu = statistics.median(r["cpu_s"] for r in sel) * 1e3
                    meas_tail = statistics.median(r["tail_s"] for r in sel) * 1e3
                    mode = "-" if world == 1 else ("on" if overlap else "off")
                    print(f"{name:<8}  {bucket_mb:10g}  {world:5d}  {mode:<7}  "
                          f"{wall * 1e3:9.1f}  {med:9.1f} ({least:5.1f})  {cpu_pred * 1e3:8.1f}  "
                          f"{cpu:8.1f}  {tail * 1e3:9.1f}  {meas_tail:9.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    table = sub.add_parser("table")
    table.add_argument("--network", nargs="+", choices=list(NETWORKS), default=list(NETWORKS))
    table.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 100])
    table.add_argument("--tc-ms", nargs="*", help="MODEL=MS: a compute time per step of yours")
    table.add_argument("--copy-gbs", type=float, help="memory copy GB/s (default: per network)")
    check = sub.add_parser("check")
    check.add_argument("--window", nargs="+", required=True)
    check.add_argument("--comm", required=True)
    check.add_argument("--step", nargs="+", required=True)
    check.add_argument("--cores", type=int, default=2)
    check.add_argument("--copy-gbs", type=float, default=10.0, help="memory copy GB/s")
    check.add_argument(
        "--use-cpu", action="store_true", help="T_c from the one-rank CPU time, not wall time"
    )
    args = parser.parse_args()
    run_table(args) if args.what == "table" else run_check(args)


if __name__ == "__main__":
    main()
