"""Time the fitting node alone, the plain node (``accel.fitting_node``) against the one with
compiled elementwise loops (``accel.fitting_compiled``), in one process, alternating rounds.

The water step's shapes: two atom types (64 and 128 rows), descriptor width 1600, fitting
[240, 240, 240] with resnet_dt; forward (energy and dE/dD) and the backward of a loss on both,
the input gradient included, as in a training step.

    python benchmarks/fitting_node.py [--precision float32 float64] [--threads 1]
        [--rounds 9] [--calls 100]

Prints per precision and node the median (and range over rounds) of the CPU time and the wall
time per call, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", nargs="+", default=["float32", "float64"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from mdtrain.memory import keep_freed_memory
    from mdtrain.model.accel.fitting_compiled import fitting_node_for, plain_fitting_node
    from mdtrain.model.accel.fitting_node import fitting_with_grad
    from mdtrain.model.accel.kernel_nodes import KernelEmbedding
    from mdtrain.model.accel.kernels import load_kernels
    from mdtrain.model.fitting import EnergyFitting

    keep_freed_memory()
    nodes = {
        "plain": plain_fitting_node,
        "compiled": fitting_node_for(KernelEmbedding(load_kernels())),
    }
    atype = torch.tensor([0] * 64 + [1] * 128)
    for name in args.precision:
        dtype = getattr(torch, name)
        gen = torch.Generator().manual_seed(0)
        fitting = EnergyFitting(2, 1600, [240, 240, 240], dtype=dtype, seed=1)
        d = torch.randn(1, 192, 1600, generator=gen).to(dtype).requires_grad_(True)
        cot_e = torch.randn(1, 192, generator=gen, dtype=torch.float64)
        cot_g = torch.randn(1, 192, 1600, generator=gen).to(dtype)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in nodes}
        for _ in range(args.rounds):
            for key, node in nodes.items():
                for _ in range(5):  # warm-up
                    e, g = fitting_with_grad(fitting, d, atype, node)
                    torch.autograd.backward([e, g], [cot_e, cot_g])
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(args.calls):
                    e, g = fitting_with_grad(fitting, d, atype, node)
                    torch.autograd.backward([e, g], [cot_e, cot_g])
                times[key].append(
                    (
                        (time.process_time() - cpu) / args.calls * 1e3,
                        (time.perf_counter() - wall) / args.calls * 1e3,
                    )
                )
        for key, values in times.items():
            cpu = [v[0] for v in values]
            wall = [v[1] for v in values]
            print(
                f"{name} {args.threads} thread(s) {key:8s} CPU ms {statistics.median(cpu):.2f} "
                f"({min(cpu):.2f}-{max(cpu):.2f})  wall ms {statistics.median(wall):.2f} "
                f"({min(wall):.2f}-{max(wall):.2f})"
            )


if __name__ == "__main__":
    main()
