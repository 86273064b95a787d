"""Time the compiled embedding kernels' node alone (``_KernelEmbedContract``: G, dG/ds and
T = Σ R̃ᵀG, and its backward) on the calls of one training step of ``model_step.py``'s
synthetic 192-atom water frame: the step runs once with the node's inputs and cotangents
recorded (two calls, one per neighbour type), then the node's forward and backward are timed
on them alone, CPU time of the process (medians over --reps), with no other work in between.

    python benchmarks/embed_kernels.py [--precision float32|float64] [--threads T] [--reps N]
        [--against TREE]

It imports mdtrain from PYTHONPATH. ``--against TREE`` builds TREE's compiled sources too
(with its own ``kernels.py`` loader) and runs the node on TREE's library and on this one in
turn, per repetition, in one process: paired ratios (this/other) of CPU and wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch
from model_step import CONFIG, water_inputs

from mdtrain.model.accel import build, kernel_nodes
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


def other_kernels(tree: Path):
    """TREE's compiled library (its csrc sources, built like this tree's) loaded by TREE's
    own ``kernels.py``, whose ABI it matches."""
    csrc = tree / "mdtrain" / "model" / "accel" / "csrc"
    saved = build.SOURCES, build.HEADERS
    build.SOURCES, build.HEADERS = sorted(csrc.glob("*.cpp")), sorted(csrc.glob("*.h"))
    try:
        path = build.build(os.environ.get("CXX", "c++"))
    finally:
        build.SOURCES, build.HEADERS = saved
    spec = importlib.util.spec_from_file_location("other_kernels", csrc.parent / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Kernels(path)


def run(calls: list[dict], kernels=None) -> tuple[float, float, float, float]:
    """CPU and wall seconds of the node's forwards and of its backwards over the recorded
    calls (on ``kernels`` instead of the recorded library, if given)."""
    spent = [0.0] * 4
    for call in calls:
        rows, recorded, plan, layout = call["args"]
        args = (rows, kernels or recorded, plan, layout)
        start, wall0 = time.process_time(), time.perf_counter()
        outs = kernel_nodes._KernelEmbedContract.apply(*args, *call["params"])
        middle, wall1 = time.process_time(), time.perf_counter()
        outs[0].grad_fn.row_grad = call["row_grad"]
        pairs = [(o, g) for o, g in zip(outs, call["cot"], strict=True) if g is not None]
        torch.autograd.grad([o for o, _ in pairs], call["params"], [g for _, g in pairs])
        spent[0] += middle - start
        spent[1] += time.process_time() - middle
        spent[2] += wall1 - wall0
        spent[3] += time.perf_counter() - wall1
    return tuple(spent)


def compare(calls: list[dict], other, reps: int) -> None:
    """This library and TREE's alternating per repetition: medians and paired ratios."""
    times: dict[str, list] = {"other": [], "this": []}
    for r in range(reps + 3):
        for name in ("other", "this") if r % 2 else ("this", "other"):
            spent = run(calls, other if name == "other" else None)
            if r >= 3:
                times[name].append(spent)
    for name, runs in times.items():
        f, b, fw, bw = (1e3 * statistics.median(x[k] for x in runs) for k in range(4))
        print(
            f"{name}: forward cpu {f:.2f} wall {fw:.2f} ms, backward cpu {b:.2f} wall {bw:.2f} ms"
        )
    labels = ("forward cpu", "backward cpu", "forward wall", "backward wall")
    ratios = [
        statistics.median(t[k] / o[k] for t, o in zip(times["this"], times["other"], strict=True))
        for k in range(4)
    ]
    print(
        "paired this/other: "
        + ", ".join(f"{n} {q:.3f}" for n, q in zip(labels, ratios, strict=True))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=["float64", "float32"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--against", type=Path, help="another tree, run in turn with this one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    calls = recorded_calls(args.precision)
    if args.against is not None:
        print(
            f"{args.precision}, {args.threads} thread(s), {len(calls)} calls per step, {args.reps} reps"
        )
        compare(calls, other_kernels(args.against), args.reps)
        return
    for _ in range(3):
        run(calls)
    forward, backward, *_ = zip(*(run(calls) for _ in range(args.reps)), strict=True)
    print(
        f"{args.precision}, {args.threads} thread(s), {len(calls)} calls per step: "
        f"forward {1e3 * statistics.median(forward):.2f} ms, backward "
        f"{1e3 * statistics.median(backward):.2f} ms of CPU per step (medians of {args.reps})"
    )


if __name__ == "__main__":
    main()
