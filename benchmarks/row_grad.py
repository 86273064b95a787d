"""The embedding's row gradients alone: ``form.row_gradients`` (dE/dT from dE/dD, the row
gradients of every block, what the force node receives) and its backward to dE/dD, on
``model_step.py``'s 192-atom water frame, for the mdtrain on PYTHONPATH (run it with another
tree's mdtrain to compare: its own API only).

    python benchmarks/row_grad.py [--precision float64|float32] [--threads T] [--calls N]
        [--rounds R]

Each round times N calls of the forward and N of forward + backward (random dE/dD and
cotangent, fixed seeds); prints the medians over the rounds of each round's median CPU time
and wall time per call, and a checksum of the results (the same for trees that compute the
same bits).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from model_step import BOX, CONFIG, water_box

from mdtrain.model.backend import build_model
from mdtrain.model.stats import PairStatSums
from mdtrain.neighbors.layout import layout_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=["float64", "float32"], default="float64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = {
        **CONFIG,
        "descriptor": {**CONFIG["descriptor"], "precision": args.precision},
        "fitting_net": {**CONFIG["fitting_net"], "precision": args.precision},
    }
    model = build_model(config, backend="kernels")
    coord, atype = water_box()
    box = np.eye(3) * BOX
    nlist, shift, _ = layout_of(model).build(coord, box, atype, model.rcut, model.sel)
    sums = PairStatSums.of_model(model)
    sums.add_frame(coord, box, atype)
    davg, dstd = model.descriptor.stats_from_items(sums.items())
    model.descriptor.set_stats(torch.from_numpy(davg), torch.from_numpy(dstd))
    types = torch.tensor(atype)
    cell, lists = torch.tensor(box[None]), torch.tensor(nlist[None])
    diff = model.pair_vectors(torch.tensor(coord[None]), cell, lists, torch.tensor(shift[None]))
    form, desc, ops = model.form, model.descriptor, model.embedding
    env = form.environment(desc, diff, lists, types)
    _, cache = form.contract(desc, ops, env, 1, len(atype))
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.precision)
    grad = torch.randn(1, len(atype), desc.dim_out, generator=gen, dtype=torch.float64)
    grad = grad.to(dtype).requires_grad_(True)
    first = form.row_gradients(desc, ops, grad, cache, types)
    cots = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype) for p in first]

    def forward() -> list[torch.Tensor]:
        return form.row_gradients(desc, ops, grad, cache, types)

    def both() -> torch.Tensor:
        (g,) = torch.autograd.grad(forward(), [grad], cots)
        return g

    with torch.no_grad():
        total = sum(float(p.double().abs().sum()) for p in forward())
    total += float(both().abs().sum())
    print(
        f"{args.precision}, {args.threads} thread(s), pieces {[tuple(p.shape) for p in first]}, "
        f"checksum {total!r}"
    )
    times: dict[str, list[tuple[float, float]]] = {"forward": [], "forward+backward": []}
    for _ in range(args.rounds):
        for name, fn in (("forward", forward), ("forward+backward", both)):
            cpu, wall = [], []
            for _ in range(args.calls):
                c0, w0 = time.process_time(), time.perf_counter()
                fn()
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
            times[name].append((statistics.median(cpu), statistics.median(wall)))
    for name, rounds in times.items():
        cpu = [1e3 * c for c, _ in rounds]
        wall = [1e3 * w for _, w in rounds]
        print(
            f"{name:17s} cpu {statistics.median(cpu):6.3f} ms ({min(cpu):.3f}-{max(cpu):.3f}), "
            f"wall {statistics.median(wall):6.3f} ms ({min(wall):.3f}-{max(wall):.3f}) "
            f"over {args.rounds} rounds"
        )


if __name__ == "__main__":
    main()
