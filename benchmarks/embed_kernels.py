"""Time the compiled embedding kernels' node alone (``_KernelEmbedContract``: G, dG/ds and
T = Σ R̃ᵀG, and its backward) on the calls of one training step of ``model_step.py``'s
synthetic 192-atom water frame: the step runs once with the node's inputs and cotangents
recorded (two calls, one per neighbour type), then the node's forward and backward are timed
on them alone, CPU time of the process (medians over --reps), with no other work in between.

    python benchmarks/embed_kernels.py [--precision float32|float64] [--threads T] [--reps N]

It imports mdtrain from PYTHONPATH: alternate processes of two trees to compare them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from model_step import CONFIG, water_inputs

from mdtrain.model.accel import kernel_nodes
from mdtrain.model.backend import build_model

try:  # the allocator setting as the commands use it (older trees: mdtrain.memory)
    from mdtrain.heap import keep_freed_memory
except ImportError:
    from mdtrain.memory import keep_freed_memory


def recorded_calls(precision: str) -> list[dict]:
    """The node's inputs and cotangents in one training step (forces in the loss)."""
    node = kernel_nodes._KernelEmbedContract
    forward, backward = node.forward, node.backward
    calls: list[dict] = []

    def record_forward(ctx, rows, kernels, plan, layout, *params):
        ctx.call = len(calls)
        calls.append({"args": (rows.clone(), kernels, plan, layout), "params": params})
        return forward(ctx, rows, kernels, plan, layout, *params)

    def record_backward(ctx, *cotangents):
        call = calls[ctx.call]
        call["cot"] = [None if c is None else c.clone() for c in cotangents]
        call["row_grad"] = None if ctx.row_grad is None else tuple(ctx.row_grad)
        return backward(ctx, *cotangents)

    config = {**CONFIG}
    for part in ("descriptor", "fitting_net"):
        config[part] = {**config[part], "precision": precision}
    model = build_model(config, backend="kernels")
    inputs, _ = water_inputs(model)
    node.forward, node.backward = staticmethod(record_forward), staticmethod(record_backward)
    try:
        out = model(*inputs)
        (out["energy"].sum() + (out["force"] ** 2).sum()).backward()
    finally:
        node.forward, node.backward = staticmethod(forward), staticmethod(backward)
    for call in calls:
        call["params"] = [p.detach().clone().requires_grad_(True) for p in call["params"]]
    return calls


def run(calls: list[dict]) -> tuple[float, float]:
    """CPU seconds of the node's forwards and of its backwards over the recorded calls."""
    spent_forward = spent_backward = 0.0
    for call in calls:
        start = time.process_time()
        outs = kernel_nodes._KernelEmbedContract.apply(*call["args"], *call["params"])
        middle = time.process_time()
        outs[0].grad_fn.row_grad = call["row_grad"]
        pairs = [(o, g) for o, g in zip(outs, call["cot"], strict=True) if g is not None]
        torch.autograd.grad([o for o, _ in pairs], call["params"], [g for _, g in pairs])
        spent_forward += middle - start
        spent_backward += time.process_time() - middle
    return spent_forward, spent_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=["float64", "float32"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    calls = recorded_calls(args.precision)
    for _ in range(3):
        run(calls)
    forward, backward = zip(*(run(calls) for _ in range(args.reps)), strict=True)
    print(
        f"{args.precision}, {args.threads} thread(s), {len(calls)} calls per step: "
        f"forward {1e3 * statistics.median(forward):.2f} ms, backward "
        f"{1e3 * statistics.median(backward):.2f} ms of CPU per step (medians of {args.reps})"
    )


if __name__ == "__main__":
    main()
