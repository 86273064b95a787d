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

import torch
from model_step import CONFIG, median_time, water_inputs

from mdtrain.model.backend import build_model


def _spread(seconds: list[float]) -> str:
    """The rounds' median and range, in ms."""
    ms = [1e3 * s for s in seconds]
    return f"{statistics.median(ms):6.3f} ms ({min(ms):.3f}-{max(ms):.3f})"


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
    (coord, types, cell, lists, shift), _ = water_inputs(model)
    diff = model.pair_vectors(coord, cell, lists, shift)
    form, desc, ops = model.form, model.descriptor, model.embedding
    env = form.environment(desc, diff, lists, types)
    _, cache = form.contract(desc, ops, env, 1, len(types))
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.precision)
    grad = torch.randn(1, len(types), desc.dim_out, generator=gen, dtype=torch.float64)
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
        times["forward"].append(median_time(forward, args.calls, warmup=0))
        times["forward+backward"].append(median_time(both, args.calls, warmup=0))
    for name, rounds in times.items():
        wall, cpu = _spread([w for w, _ in rounds]), _spread([c for _, c in rounds])
        print(f"{name:17s} cpu {cpu}, wall {wall} over {args.rounds} rounds")


if __name__ == "__main__":
    main()
