"""Whole training steps (``model_step.py``'s synthetic 192-atom water frame: forward, forces,
E+F loss, backward, Adam) in one process, with the kernels backend's embedding contraction
(``KernelEmbedding.contract``: the block plan, the kernels' node, the padded slots' share)
taken in turn from another tree's ``kernel_nodes.py`` and from the imported mdtrain, per step:
paired ratios resolve differences of a percent on a busy machine, where separate processes
cannot. The kernels' node itself is this tree's in both.

    python benchmarks/embed_contract.py --against TREE [--precision float32|float64]
        [--threads T] [--steps N]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch
from model_step import precision_config, training_step, water_inputs

from mdtrain.memory import keep_freed_memory
from mdtrain.model.accel import kernel_nodes
from mdtrain.model.backend import build_model


def other_contract(tree: Path):
    """``KernelEmbedding.contract`` of the tree's ``kernel_nodes.py``, on this tree's node
    class (the row-gradient node checks where G came from)."""
    path = tree / "mdtrain" / "model" / "accel" / "kernel_nodes.py"
    spec = importlib.util.spec_from_file_location("other_kernel_nodes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._KernelEmbedContract = kernel_nodes._KernelEmbedContract
    return module.KernelEmbedding.contract


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, required=True, help="the other tree")
    parser.add_argument("--precision", choices=["float64", "float32"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    model = build_model(precision_config(args.precision), backend="kernels")
    inputs, _ = water_inputs(model)
    step = training_step(model, inputs)

    contracts = {
        "other": other_contract(args.against),
        "this": kernel_nodes.KernelEmbedding.contract,
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in contracts}
    try:
        for r in range(args.steps + 4):
            for name in ("other", "this") if r % 2 else ("this", "other"):
                kernel_nodes.KernelEmbedding.contract = contracts[name]
                wall, cpu = time.perf_counter(), time.process_time()
                step()
                if r >= 4:  # warm-up
                    times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    finally:
        kernel_nodes.KernelEmbedding.contract = contracts["this"]
    for name, pairs in times.items():
        wall, cpu = (statistics.median(p[k] for p in pairs) for k in (0, 1))
        print(f"{name}: wall {1e3 * wall:.2f} ms, cpu {1e3 * cpu:.2f} ms per step")
    ratios = [
        [t[k] / o[k] for t, o in zip(times["this"], times["other"], strict=True)] for k in (0, 1)
    ]
    print(
        f"{args.precision}, {args.threads} thread(s), {args.steps} steps each: paired "
        f"this/other wall {statistics.median(ratios[0]):.3f}, cpu {statistics.median(ratios[1]):.3f}"
    )


if __name__ == "__main__":
    main()
