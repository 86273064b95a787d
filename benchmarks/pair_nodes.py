"""The environment matrix and the force path alone: the PyTorch nodes (``environment_node``,
``force_node``; the fused backend's) against the compiled pair kernels (``pair_kernels``; the
kernels backend's), in one process, alternating rounds, on ``model_step.py``'s 192-atom water
frame (the water model: sel [46, 92], type_one_side).

    python benchmarks/pair_nodes.py [--precision float64|float32] [--threads T]
        [--rounds R] [--calls N] [--steps S]

Both are the kernels backend's model with the same weights, one with the PyTorch nodes. Each
round times N calls of each part per implementation (medians of the process CPU time and of
the wall time per call): the environment (``form.environment``: the pair plan, the matrix,
its coefficients, scale, transposed rows and slot widths) and the force node's forward and
backward (forces and virial from random dE/dR̃, the backward of a force + virial loss); with
``--steps``, also S whole training steps (``model_step.py``'s: forward, energy + force loss,
backward, Adam), so that the two steps meet the same load. It first checks that both give
the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from model_step import BOX, CONFIG, water_box

from mdtrain.model.accel.explicit import FORMS
from mdtrain.model.accel.force_node import forces_and_virial
from mdtrain.model.backend import build_model
from mdtrain.model.stats import PairStatSums
from mdtrain.neighbors.layout import layout_of
from mdtrain.train.optimizer import make_adam


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=["float64", "float32"], default="float64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--steps", type=int, default=0, help="whole training steps a round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = {
        **CONFIG,
        "descriptor": {**CONFIG["descriptor"], "precision": args.precision},
        "fitting_net": {**CONFIG["fitting_net"], "precision": args.precision},
    }
    models = {"torch nodes": build_model(config, backend="kernels")}
    models["compiled"] = build_model(config, backend="kernels")
    plain = models["torch nodes"]
    plain.form = FORMS[plain.descriptor.type_name]  # no compiled pairs
    plain.load_state_dict(models["compiled"].state_dict())
    coord, atype = water_box()
    box = np.eye(3) * BOX
    first = models["compiled"]
    nlist, shift, _ = layout_of(first).build(coord, box, atype, first.rcut, first.sel)
    sums = PairStatSums.of_model(first)
    sums.add_frame(coord, box, atype)
    davg, dstd = first.descriptor.stats_from_items(sums.items())
    for model in models.values():
        model.descriptor.set_stats(torch.from_numpy(davg), torch.from_numpy(dstd))
    frame = (torch.tensor(coord[None]), torch.tensor(box[None]))
    lists = (torch.tensor(nlist[None]), torch.tensor(shift[None]))
    types = torch.tensor(atype)
    diff = first.pair_vectors(frame[0], frame[1], *lists)

    def environment(model):
        return model.form.environment(model.descriptor, diff, lists[0], types)

    envs = {name: environment(m) for name, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    width = envs["compiled"].force.scale.shape[-1]
    pieces = [
        torch.randn(*g.rows.shape[:2], width, generator=gen, dtype=g.rows.dtype)
        for g in envs["compiled"].groups
    ]
    f_w = torch.randn(1, 1, len(atype), 3, dtype=torch.float64, generator=gen)
    v_w = torch.randn(1, 1, 3, 3, dtype=torch.float64, generator=gen)

    def force(env):
        ps = [p.clone().requires_grad_(True) for p in pieces]
        f, v = forces_and_virial(env.force, ps)
        ((f * f_w).sum() + (v * v_w).sum()).backward()
        return [f.detach(), v.detach(), *(p.grad for p in ps)]

    a, b = envs.values()
    same = all(torch.equal(x, y) for x, y in zip(force(a), force(b), strict=True))
    same &= all(torch.equal(x.rows, y.rows) for x, y in zip(a.groups, b.groups, strict=True))
    print(
        f"same bits: {same}; {args.precision}, {args.threads} thread(s), torch {torch.__version__}"
    )
    parts = {
        "environment": lambda name: environment(models[name]),
        "force fwd+bwd": lambda name: force(envs[name]),
    }
    if args.steps:
        inputs = (frame[0], types, frame[1], *lists)
        optimizers = {n: make_adam(list(m.parameters()), 1e-3) for n, m in models.items()}
        f_label = torch.zeros(1, len(atype), 3, dtype=torch.float64)

        def train_step(name: str) -> None:
            model, optimizer = models[name], optimizers[name]
            model.train()
            optimizer.zero_grad(set_to_none=True)
            out = model(*inputs)
            loss = 0.02 * ((out["energy"] + 187.0 * 32) ** 2).mean() / len(atype)
            loss = loss + 1000.0 * ((out["force"] - f_label) ** 2).mean()
            loss.backward()
            optimizer.step()

        parts["training step"] = train_step
    calls = {"training step": args.steps}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for name in models:
            for part, fn in parts.items():
                cpu, wall = [], []
                for _ in range(calls.get(part, args.calls)):
                    c0, w0 = time.process_time(), time.perf_counter()
                    fn(name)
                    cpu.append(time.process_time() - c0)
                    wall.append(time.perf_counter() - w0)
                times.setdefault((part, name), []).append(
                    (statistics.median(cpu), statistics.median(wall))
                )
    for (part, name), rounds in times.items():
        cpu = [1e3 * c for c, _ in rounds]
        wall = [1e3 * w for _, w in rounds]
        print(
            f"{part:14s} {name:12s} cpu {statistics.median(cpu):6.3f} ms "
            f"({min(cpu):.3f}-{max(cpu):.3f}), wall {statistics.median(wall):6.3f} ms "
            f"({min(wall):.3f}-{max(wall):.3f}) over {args.rounds} rounds"
        )


if __name__ == "__main__":
    main()
