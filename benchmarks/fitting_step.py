"""Whole float32 training steps (``model_step.py``'s synthetic 192-atom water frame: forward,
forces, E+F loss, backward, Adam) on the kernels backend in one process, with the fitting node
taken in turn per step from the PyTorch path (``fitting_node.fitting_with_grad``) and the
compiled one (``fitting_compiled``, what the model was built with): paired ratios resolve
differences of a percent on a busy machine, where separate processes cannot.

    python benchmarks/fitting_step.py [--threads T] [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from model_step import precision_config, training_step, water_inputs

from mdtrain.memory import keep_freed_memory
from mdtrain.model.accel.fitting_compiled import CompiledFitting
from mdtrain.model.accel.fitting_node import fitting_with_grad
from mdtrain.model.backend import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    model = build_model(precision_config("float32"), backend="kernels")
    if not isinstance(model.fitting_node, CompiledFitting):
        raise SystemExit("this model did not get the compiled fitting node")
    inputs, _ = water_inputs(model)
    step = training_step(model, inputs)
    nodes = {"pytorch": fitting_with_grad, "compiled": model.fitting_node}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in nodes}
    for r in range(args.steps + 4):
        for name in ("pytorch", "compiled") if r % 2 else ("compiled", "pytorch"):
            model.fitting_node = nodes[name]
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            if r >= 4:  # warm-up
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    for name, pairs in times.items():
        wall, cpu = (statistics.median(p[k] for p in pairs) for k in (0, 1))
        print(f"{name}: wall {1e3 * wall:.2f} ms, cpu {1e3 * cpu:.2f} ms per step")
    ratios = [
        [c[k] / p[k] for c, p in zip(times["compiled"], times["pytorch"], strict=True)]
        for k in (0, 1)
    ]
    print(
        f"float32, {args.threads} thread(s), {args.steps} steps each: paired compiled/pytorch "
        f"wall {statistics.median(ratios[0]):.3f}, cpu {statistics.median(ratios[1]):.3f}"
    )


if __name__ == "__main__":
    main()
