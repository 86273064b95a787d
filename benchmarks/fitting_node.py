"""The fitting net's node alone (``fitting_node.fitting_with_grad``: energies and dE/dD of
the water model's two per-type nets, 1600 -> 240 -> 240 -> 240 -> 1, on 64 O and 128 H rows,
forward and the backward of a loss on both), this tree's against another tree's
``fitting_node.py``, in one process, alternating rounds.

    python benchmarks/fitting_node.py --against OLD/mdtrain/model/accel/fitting_node.py
        [--precision float64|float32] [--threads T] [--rounds R] [--calls N] [--tiny]
    python benchmarks/fitting_node.py --compiled [--threads T] [--rounds R] [--calls N]

``--compiled``: this tree's PyTorch node ("other") against its compiled float32 node ("this",
``fitting_compiled``), which a float32 model on the kernels gets; instead of the bits, the
largest relative difference of the two (float32 roundings) is printed.

The other tree's module is loaded from its file, with the ``fitting_types.py`` and
``fitting_sweep.py`` beside it (the rest of mdtrain comes from this tree). Each round times N calls of each (process CPU time and wall time per call), the
order of the two alternating between rounds; the report gives the medians and ranges and
the per-round difference. ``--tiny`` runs the same nets on 16-wide layers and 12 rows:
what is left is the nodes' fixed cost (Python, dispatch, allocation). First checks that
both give the same bits.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from mdtrain.memory import keep_freed_memory
from mdtrain.model.accel import fitting_node
from mdtrain.model.accel.fitting_compiled import CompiledFitting
from mdtrain.model.accel.kernels import load_kernels
from mdtrain.model.fitting import EnergyFitting

PACKAGE = "mdtrain.model.accel"


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(path: str):
    """The other tree's fitting_node.py, importing its own fitting_sweep.py and
    fitting_types.py (where they exist) instead of this tree's."""
    folder = Path(path).parent
    names = ["fitting_sweep", "fitting_types"]  # fitting_types imports fitting_sweep
    saved = {n: sys.modules.get(f"{PACKAGE}.{n}") for n in names}
    try:
        for n in names:
            if (folder / f"{n}.py").exists():
                sys.modules[f"{PACKAGE}.{n}"] = _module(f"{PACKAGE}.{n}", folder / f"{n}.py")
        return _module("other_fitting_node", Path(path))
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(f"{PACKAGE}.{n}", None)
            else:
                sys.modules[f"{PACKAGE}.{n}"] = module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="another tree's fitting_node.py")
    parser.add_argument("--compiled", action="store_true", help="PyTorch node vs compiled")
    parser.add_argument("--precision", choices=["float64", "float32"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="16-wide nets: the fixed cost")
    args = parser.parse_args()
    if args.compiled == bool(args.against):
        parser.error("give one of --against and --compiled")
    if args.compiled:
        args.precision = "float32"
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as mdtrain train does
    dtype = getattr(torch, args.precision)
    dim, neuron, counts = (16, [16] * 3, (4, 8)) if args.tiny else (1600, [240] * 3, (64, 128))
    fitting = EnergyFitting(2, dim, neuron, resnet_dt=True, dtype=dtype, seed=1)
    atype = torch.tensor([0] * counts[0] + [1] * counts[1])
    gen = torch.Generator().manual_seed(0)
    descriptor = torch.randn(1, len(atype), dim, generator=gen, dtype=dtype)
    descriptor.requires_grad_(True)
    weights = torch.randn(1, len(atype), dim, generator=gen, dtype=dtype)
    params = list(fitting.parameters())
    if args.compiled:
        trees = {"other": fitting_node.fitting_with_grad, "this": CompiledFitting(load_kernels())}
    else:
        trees = {
            "other": _load(args.against).fitting_with_grad,
            "this": fitting_node.fitting_with_grad,
        }

    def step(node) -> list[torch.Tensor]:
        energy, grad = node(fitting, descriptor, atype)
        (energy.sum() + (grad * weights).sum()).backward()
        out = [energy.detach(), grad.detach(), descriptor.grad, *(p.grad for p in params)]
        descriptor.grad = None
        for p in params:
            p.grad = None
        return out

    pairs = list(zip(*(step(m) for m in trees.values()), strict=True))
    if args.compiled:
        worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
        print(f"compiled vs PyTorch: largest relative difference {worst:.1e}")
    else:
        print(f"same bits: {all(torch.equal(a, b) for a, b in pairs)}")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            for _ in range(2):
                step(trees[name])
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.calls):
                step(trees[name])
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            times[name].append((1e3 * cpu / args.calls, 1e3 * wall / args.calls))
    print(
        f"fitting node, {'tiny' if args.tiny else 'water'} shapes, {args.precision}, "
        f"{args.threads} thread(s), {args.rounds} rounds of {args.calls} calls, ms per call:"
    )
    for name, rounds in times.items():
        cpu, wall = [c for c, _ in rounds], [w for _, w in rounds]
        print(
            f"  {name:5s} CPU {statistics.median(cpu):7.3f} ({min(cpu):.3f}-{max(cpu):.3f})"
            f"  wall {statistics.median(wall):7.3f} ({min(wall):.3f}-{max(wall):.3f})"
        )
    diff = [o[0] - t[0] for o, t in zip(times["other"], times["this"], strict=True)]
    print(
        f"  other - this, CPU per round: median {statistics.median(diff):.3f} ms; "
        f"this faster in {sum(d > 0 for d in diff)} of {len(diff)} rounds"
    )


if __name__ == "__main__":
    main()
