"""Time se_e2_a's descriptor products alone: D = TᵀT< and dE/dT = T< dDᵀ + [T dD, 0], forward
and the backward of a loss on both, as torch's operations (batched BLAS products, slices, cat)
against the compiled nodes (``mdtrain.model.accel.descriptor_products``), alternating in one
process; medians of the per-call CPU and wall time. Shapes of the water model: 192 centres,
T (192, 4, 100), axis 16.

    python benchmarks/descriptor_products.py [--precision float64|float32] [--threads T]
        [--rounds N] [--centres B] [--steps S]

With ``--steps``, also S whole training steps a round of ``model_step.py``'s water model
(kernels backend; forward, energy + force loss, backward, no optimizer step so that both see
the same weights), with the compiled products and without them, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from model_step import CONFIG, water_inputs

from mdtrain.model.accel.descriptor_products import (
    DescriptorProducts,
    _Descriptor,
    _Tbar,
    torch_descriptor_of_t,
    torch_tbar_of,
)
from mdtrain.model.accel.kernels import load_kernels
from mdtrain.model.backend import build_model


def water_step(precision: str):
    """A training step (without the optimizer) of the water model on ``model_step``'s frame,
    taking whether to run the compiled products."""
    config = {
        **CONFIG,
        "descriptor": {**CONFIG["descriptor"], "precision": precision},
        "fitting_net": {**CONFIG["fitting_net"], "precision": precision},
    }
    model = build_model(config, backend="kernels")
    inputs, _ = water_inputs(model)
    atype = inputs[1]
    pairs = model.form.environment.keywords["pairs"]
    compiled = pairs.products

    def step(use: bool) -> None:
        pairs.products = compiled if use else None
        model.zero_grad(set_to_none=True)
        out = model(*inputs)
        loss = 0.02 * ((out["energy"] + 187.0 * 32) ** 2).mean() / len(atype)
        (loss + 1000.0 * (out["force"] ** 2).mean()).backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=["float64", "float32"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--centres", type=int, default=192)
    parser.add_argument("--steps", type=int, default=0, help="whole training steps a round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.precision)
    prod = DescriptorProducts(load_kernels())
    orders = prod.orders(dtype, 4, 100, 16)
    if orders is None:
        raise SystemExit("the compiled products do not reproduce this BLAS's order here")
    gen = torch.Generator().manual_seed(0)
    b = args.centres
    tmat = torch.randn(b, 4, 100, dtype=dtype, generator=gen).requires_grad_()
    dd = torch.randn(b, 100, 16, dtype=dtype, generator=gen).requires_grad_()
    d_bar = torch.randn(b, 1600, dtype=dtype, generator=gen)
    g = torch.randn(b, 4, 100, dtype=dtype, generator=gen)

    def step(compiled: bool) -> None:
        if compiled:  # the division by nnei is inside D's node
            d, t = _Descriptor.apply(prod, orders, 16, 138.0, tmat)
            tbar = _Tbar.apply(prod, orders, 138.0, t, dd)
        else:
            t = tmat / 138
            d, tbar = torch_descriptor_of_t(t, 16), torch_tbar_of(t, dd, 138)
        torch.autograd.backward([tbar, d], [g, d_bar])

    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for compiled in (False, True):
            c0, w0 = time.process_time(), time.perf_counter()
            step(compiled)
            times[compiled].append((time.process_time() - c0, time.perf_counter() - w0))
    for compiled, label in ((False, "torch operations"), (True, "compiled nodes")):
        cpu = 1e3 * statistics.median(c for c, _ in times[compiled])
        wall = 1e3 * statistics.median(w for _, w in times[compiled])
        print(f"{args.precision} {label:16s}: cpu {cpu:6.3f} ms, wall {wall:6.3f} ms (medians)")
    if args.steps:
        train = water_step(args.precision)
        rounds: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for use in (False, True):
                cpu, wall = [], []
                for _ in range(args.steps):
                    c0, w0 = time.process_time(), time.perf_counter()
                    train(use)
                    cpu.append(time.process_time() - c0)
                    wall.append(time.perf_counter() - w0)
                rounds[use].append((statistics.median(cpu), statistics.median(wall)))
        for use, label in ((False, "torch operations"), (True, "compiled nodes")):
            cpu = [1e3 * c for c, _ in rounds[use]]
            wall = [1e3 * w for _, w in rounds[use]]
            print(
                f"{args.precision} step, {label:16s}: cpu {statistics.median(cpu):6.1f} ms "
                f"({min(cpu):.1f}-{max(cpu):.1f}), wall {statistics.median(wall):6.1f} ms "
                f"({min(wall):.1f}-{max(wall):.1f}) over {args.rounds} rounds"
            )


if __name__ == "__main__":
    main()
