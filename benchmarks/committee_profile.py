"""Where a committee's step goes against a single model's, and what two threads could gain.

    python benchmarks/committee_profile.py path/to/input.json [--ensemble 4] [--steps 4]

One process, one thread: a single model and a committee of N built as ``train_step.py``
builds them (cached neighbour lists, no validation), warmed up, then each profiled over
``--steps`` training steps (torch profiler, self CPU time per operation). Operations are
grouped by kind (the compiled embedding kernels' nodes, the products, Adam, the rest) and by
the size of their largest input: below torch's grain size (32,768 elements) an elementwise
operation runs on one thread whatever the thread count. Taking those as serial and all the
rest as perfectly parallel gives each model's best two-thread speed-up (Amdahl), and so the
best two-thread committee / single ratio the same arithmetic allows: the committee's
one-thread ratio times the single model's two-thread time over the committee's, and, if the
committee used both cores perfectly, that ratio times the single model's two-thread share.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GRAIN = 32768  # at::internal::GRAIN_SIZE
KINDS = {"aten::mm": "products", "aten::addmm": "products", "aten::addmm_": "products",
         "aten::bmm": "products", "aten::baddbmm": "products", "aten::baddbmm_": "products"}  # fmt: skip


def _kind(name: str) -> str:
    if name.startswith("_Kernel"):
        return "embedding kernels"
    if "adam" in name.lower():
        return "Adam"
    return KINDS.get(name, "other")


def profile_sizes(input_path: str, sizes: list[int], steps: int) -> dict[int, dict]:
    """Self CPU time (s per step) by (kind, 'large'/'small') for each committee size."""
    from torch.profiler import ProfilerActivity, profile
    from train_step import _prepared, _trainer

    config, data, runtime = _prepared(input_path, "float64", steps, 3, 1, None)
    out = {}
    with tempfile.TemporaryDirectory() as directory:
        trainers = [
            _trainer(config, data, runtime, s, os.path.join(directory, str(s)), False)[0]
            for s in sizes
        ]
        for step in range(3):
            for t in trainers:
                t.train_step(t.lr.value(step))
        for size, trainer in zip(sizes, trainers, strict=True):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for step in range(steps):
                    trainer.train_step(trainer.lr.value(step))
            bins: dict[tuple[str, str], float] = collections.defaultdict(float)
            for e in prof.key_averages(group_by_input_shape=True):
                numels = [math.prod(s) for s in e.input_shapes if isinstance(s, list) and s]
                big = "large" if numels and max(numels) >= GRAIN else "small"
                bins[(_kind(e.key), big)] += e.self_cpu_time_total / 1e6 / steps
            out[size] = dict(bins)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="input.json")
    parser.add_argument("--ensemble", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    sizes = [1, args.ensemble]
    res = profile_sizes(args.input, sizes, args.steps)
    print(f"{args.input}: 1 thread, {args.steps} profiled steps, load {os.getloadavg()[0]:.1f}")
    kinds = sorted({k for r in res.values() for k in r}, key=lambda k: -res[sizes[-1]].get(k, 0))
    print(
        "| kind, largest input | " + " | ".join(f"{s} model(s), ms" for s in sizes) + " | ratio |"
    )
    print("| --- |" + " --- |" * (len(sizes) + 1))
    for k in kinds:
        a, b = (res[s].get(k, 0.0) * 1e3 for s in sizes)
        ratio = f"{b / a:.2f}×" if a > 0 else "–"
        print(
            f"| {k[0]}, {'≥' if k[1] == 'large' else '<'} {GRAIN} elements | {a:.1f} | {b:.1f} | {ratio} |"
        )
    total = {s: sum(res[s].values()) for s in sizes}
    serial = {
        s: sum(
            v for (kind, big), v in res[s].items() if big == "small" and kind != "embedding kernels"
        )
        for s in sizes
    }
    two = {s: serial[s] + (total[s] - serial[s]) / 2 for s in sizes}
    one_ratio = total[sizes[1]] / total[1]
    for s in sizes:
        print(
            f"{s} model(s): {total[s] * 1e3:.1f} ms of operations per step, serial share "
            f"{serial[s] / total[s]:.3f}, best 2-thread speed-up {total[s] / two[s]:.2f}"
        )
    print(
        f"committee / single: 1 thread {one_ratio:.2f}×; 2 threads at best (Amdahl, both) "
        f"{two[sizes[1]] / two[1]:.2f}×; with the committee on both cores perfectly "
        f"{total[sizes[1]] / 2 / two[1]:.2f}×"
    )


if __name__ == "__main__":
    main()
