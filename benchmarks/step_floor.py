"""The arithmetic floor of one training step, part by part, against what each part takes.

    python benchmarks/step_floor.py path/to/water [--precision float64 float32] [--steps 8]
        [--threads 1] [--frame 0] [--json FILE]

The argument is a directory holding a DeePMD se_e2_a ``input.json`` with ``type_one_side``
(the water-2000 protocol's) and its systems; the step is the training step of its model on
one frame of the first training system (batch 1, energy and force loss, Adam), on the
backend ``mdtrain train`` chooses. Statistics come from that frame alone (they change
values, not costs).

Operations are counted from the model's shapes and the frame's neighbours:

- products: 2 FLOP per multiply-add, for the rows the step needs (one embedding row per real
  neighbour, one fitting row per atom); the rows the backend evaluates (the embedding of the
  padded slots up to each block's widest centre) are shown beside them;
- elementwise: the activations (tanh) and their derivatives, counted as elements written;
- the training backward (parameter gradients through the forward, the forces included):
  twice the products of the forward parts that depend on parameters (a gradient with respect
  to the input and one with respect to the weights for every product);
- Adam: its passes over the parameters (about 12 FLOP and 7 arrays read or written per
  parameter), a memory floor.

The floor of a part is its products at the rate the CPU reaches on one large product
(a 1024³ matrix product at this precision on ``--threads`` threads, measured here), plus its
elements at the rate of a fused elementwise pass over an array held in cache (measured
here; a tanh costs more than that pass, and the tape of a step does not all stay in cache,
so this floor is a lower bound).
What each part takes comes from the torch profiler over ``--steps`` steps: the forward
pieces are timed through ``record_function`` ranges this script puts around the model's
functions, the backward by autograd node; the shares are scaled to the process CPU time per
step (``time.process_time``), so the table holds up on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

PARTS = (
    "environment matrix",
    "embedding nets + contraction (value, dG/ds, T)",
    "descriptor D = TᵀT<",
    "fitting net (value, dE/dD)",
    "force path (dE/dR̃, pull-back, forces, virial)",
    "training backward (parameter gradients)",
    "Adam",
    "loss and the rest",
)


def counts(
    model, config: dict, nlist: np.ndarray, width_rows: int
) -> dict[str, tuple[float, float, float]]:
    """``part -> (products FLOP needed, products FLOP evaluated, elementwise elements)`` for
    one step of ``model`` (se_e2_a, type_one_side; ``config`` its model section) on one
    frame's list."""
    desc_cfg, fit_cfg = config["descriptor"], config["fitting_net"]
    natoms, nnei = nlist.shape
    real = int((nlist >= 0).sum())
    neuron = [1, *desc_cfg["neuron"]]
    per_row = sum(2 * a * b for a, b in zip(neuron[:-1], neuron[1:], strict=True))
    act_row = sum(desc_cfg["neuron"])
    m, axis = neuron[-1], int(desc_cfg["axis_neuron"])
    widths = [m * axis, *fit_cfg["neuron"], 1]
    per_atom = sum(2 * a * b for a, b in zip(widths[:-1], widths[1:], strict=True))
    act_atom = sum(fit_cfg["neuron"])
    out: dict[str, tuple[float, float, float]] = {}
    out[PARTS[0]] = (real * 40.0, nnei * natoms * 40.0, real * 10.0)
    # value and tangent (dG/ds: the same products), then T = R̃ᵀG (4 x M per row)
    emb = 2 * per_row + 2 * 4 * m
    out[PARTS[1]] = (real * emb, width_rows * emb, real * 2.0 * act_row)
    out[PARTS[2]] = (natoms * 2.0 * 4 * m * axis, natoms * 2.0 * 4 * m * axis, 0.0)
    # the value, and dE/dD by the transposed products (the last layer's is a vector)
    fitting = per_atom + (per_atom - 2 * widths[-2])
    out[PARTS[3]] = (natoms * fitting, natoms * fitting, natoms * 2.0 * act_atom)
    # dT from dD (two products of 4 x M x axis per atom), dR̃ = G dTᵀ + R̃·(G' dTᵀ) per row,
    # the pull-back to pair vectors, forces and virial
    force_atom = 2 * 2.0 * 4 * m * axis
    force_row = 2 * 2.0 * m * 4 + 30 + 3 + 18
    out[PARTS[4]] = (
        natoms * force_atom + real * force_row,
        natoms * force_atom + width_rows * force_row,
        0.0,
    )
    forward_params = [PARTS[1], PARTS[3], PARTS[4]]  # the parts whose products hold weights
    out[PARTS[5]] = tuple(2 * sum(out[p][k] for p in forward_params) for k in (0, 1, 2))
    nparams = sum(p.numel() for p in model.parameters())
    out[PARTS[6]] = (12.0 * nparams, 12.0 * nparams, 7.0 * nparams)
    out[PARTS[7]] = (natoms * 30.0, natoms * 30.0, 0.0)
    return out


def rates(dtype: torch.dtype) -> tuple[float, float]:
    """FLOP/s of one 1024³ product, and elements/s of a fused elementwise pass over 64 K
    elements held in cache (``out = x + a·y``, no allocation, 100 times): the best of 10
    each, in CPU time (this process alone, so other work on the machine does not count)."""
    a = torch.randn(1024, 1024, dtype=dtype)
    c = torch.empty_like(a)
    x, y = torch.randn(1 << 16, dtype=dtype), torch.randn(1 << 16, dtype=dtype)
    z = torch.empty_like(x)
    best_mm = best_pass = float("inf")
    for _ in range(10):
        t0 = time.process_time()
        torch.mm(a, a, out=c)
        best_mm = min(best_mm, time.process_time() - t0)
        t0 = time.process_time()
        for _ in range(100):
            torch.add(x, y, alpha=0.5, out=z)
        best_pass = min(best_pass, (time.process_time() - t0) / 100)
    return 2 * 1024**3 / best_mm, x.numel() / best_pass


def _wrapped(module, name: str, label: str) -> None:
    """``module.name`` timed as the profiler range ``label`` (this process only)."""
    setattr(module, name, _timed(getattr(module, name), label))


def _timed(inner, label: str):
    def timed(*args, **kwargs):
        with torch.profiler.record_function(label):
            return inner(*args, **kwargs)

    return timed


def _instrument(model) -> None:
    from mdtrain.model.accel import explicit

    model.fitting_node = _timed(model.fitting_node, PARTS[3])  # the node chosen at build
    _wrapped(explicit, "forces_and_virial", PARTS[4])
    # the descriptor's explicit form, which the model looked up when it was built
    form = model.form
    model.form = form._replace(
        environment=_timed(form.environment, PARTS[0]),
        contract=_timed(form.contract, "contract"),
        row_gradients=_timed(form.row_gradients, PARTS[4]),
    )
    desc = model.descriptor
    desc.descriptor_of_t = _timed(desc.descriptor_of_t, PARTS[2])


def measured(prof, steps: int, cpu_per_step: float) -> dict[str, float]:
    """Seconds per step of each part: the profile's wall shares scaled to the CPU time."""
    events = prof.events()
    totals: dict[str, float] = defaultdict(float)
    step_total = 0.0
    for e in events:
        if e.name == "step":
            step_total += e.cpu_time_total
    for e in events:
        name = e.name
        if name in PARTS:
            parent = e.cpu_parent
            nested = False
            while parent is not None:  # count a range once, at its outermost
                if parent.name in PARTS:
                    nested = True
                    break
                parent = parent.cpu_parent
            if not nested:
                totals[name] += e.cpu_time_total
        elif name == "contract":
            inner = sum(c.cpu_time_total for c in e.cpu_children if c.name == PARTS[2])
            totals[PARTS[1]] += e.cpu_time_total - inner
        elif name.startswith("autograd::engine::evaluate_function"):
            totals[PARTS[5]] += e.cpu_time_total
        elif name == "adam":
            totals[PARTS[6]] += e.cpu_time_total
    rest = step_total - sum(totals.values())
    totals[PARTS[7]] = max(rest, 0.0)
    scale = cpu_per_step * steps / step_total
    return {k: v * scale / steps for k, v in totals.items()}


def run(input_dir: str, precision: str, steps: int, frame: int) -> dict:
    from mdtrain.config import load_config
    from mdtrain.data import open_system
    from mdtrain.memory import keep_freed_memory
    from mdtrain.model.backend import build_model
    from mdtrain.model.stats import PairStatSums
    from mdtrain.neighbors.layout import layout_of
    from mdtrain.train.optimizer import make_adam

    path = os.path.join(input_dir, "input.json")
    config = load_config(path)
    model_cfg = config["model"]
    desc_cfg = model_cfg["descriptor"]
    if desc_cfg["type"] != "se_e2_a" or not desc_cfg.get("type_one_side"):
        raise SystemExit(f"{path}: the counts are written for se_e2_a with type_one_side")
    for section in ("descriptor", "fitting_net"):
        model_cfg[section]["precision"] = precision
    systems = config["training"]["training_data"]["systems"]
    first = systems if isinstance(systems, str) else systems[0]
    system = open_system(os.path.join(input_dir, first), model_cfg["type_map"])
    keep_freed_memory()
    model = build_model(model_cfg)
    data = system.frames([frame])
    coord, box = data["coord"][0], data["box"][0]
    nlist, shift, _ = layout_of(model).build(coord, box, system.atype, model.rcut, model.sel)
    sums = PairStatSums.of_model(model)
    sums.add_frame(coord, box, system.atype)
    davg, dstd = model.descriptor.stats_from_items(sums.items())
    model.descriptor.set_stats(torch.from_numpy(davg), torch.from_numpy(dstd))
    inputs = (
        torch.tensor(coord[None]),
        torch.tensor(system.atype),
        torch.tensor(box[None]),
        torch.tensor(nlist[None]),
        torch.tensor(shift[None]),
    )
    e_label = torch.tensor(data["energy"])
    f_label = torch.tensor(data["force"])
    optimizer = make_adam(list(model.parameters()), 1e-3)
    natoms = len(system.atype)

    def step() -> None:
        with torch.profiler.record_function("step"):
            optimizer.zero_grad(set_to_none=True)
            out = model(*inputs)
            loss = 0.02 * ((out["energy"] - e_label) ** 2).mean() / natoms
            loss = loss + 1000.0 * ((out["force"] - f_label) ** 2).mean()
            loss.backward()
            with torch.profiler.record_function("adam"):
                optimizer.step()

    model.train()
    for _ in range(3):
        step()
    cpu = []
    for _ in range(steps):
        c0 = time.process_time()
        step()
        cpu.append(time.process_time() - c0)
    cpu_per_step = statistics.median(cpu)
    _instrument(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    parts = measured(prof, steps, cpu_per_step)
    # rows the backend embeds: per neighbour type, every centre up to the type's widest slot
    width_rows = 0
    for t in range(len(model.sel)):
        lo, hi = model.descriptor.offsets[t], model.descriptor.offsets[t + 1]
        used = np.nonzero((nlist[:, lo:hi] >= 0).any(axis=0))[0]
        width_rows += natoms * (int(used.max()) + 1 if used.size else 0)
    ops = counts(model, model_cfg, nlist, width_rows)
    dtype = torch.float64 if precision == "float64" else torch.float32
    mm_rate, pass_rate = rates(dtype)
    return {
        "precision": precision,
        "backend": model.backend,
        "natoms": natoms,
        "real_neighbours": int((nlist >= 0).sum()),
        "embedded_rows": width_rows,
        "cpu_s_per_step": cpu_per_step,
        "gemm_flop_s": mm_rate,
        "pass_elements_s": pass_rate,
        "parts": {
            name: {
                "flop_needed": ops[name][0],
                "flop_evaluated": ops[name][1],
                "elements": ops[name][2],
                "floor_s": ops[name][0] / mm_rate + ops[name][2] / pass_rate,
                "measured_s": parts.get(name, 0.0),
            }
            for name in PARTS
        },
    }


def table(result: dict) -> str:
    lines = [
        f"{result['precision']}, backend {result['backend']}, {result['natoms']} atoms, "
        f"{result['real_neighbours']} real neighbours ({result['embedded_rows']} embedded "
        f"rows), {torch.get_num_threads()} thread(s): step {result['cpu_s_per_step'] * 1e3:.1f} "
        f"ms CPU; 1024³ product {result['gemm_flop_s'] / 1e9:.1f} GFLOP/s, elementwise pass "
        f"{result['pass_elements_s'] / 1e9:.2f} G elements/s",
        "",
        "| part | products MFLOP needed (evaluated, at most) | elements M | floor ms | measured ms "
        "| measured / floor |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    total_floor = total_meas = 0.0
    for name, p in result["parts"].items():
        floor, meas = p["floor_s"] * 1e3, p["measured_s"] * 1e3
        total_floor += floor
        total_meas += meas
        ratio = f"{meas / floor:.1f}×" if floor > 1e-3 else "—"
        lines.append(
            f"| {name} | {p['flop_needed'] / 1e6:.1f} ({p['flop_evaluated'] / 1e6:.1f}) | "
            f"{p['elements'] / 1e6:.2f} | {floor:.2f} | {meas:.2f} | {ratio} |"
        )
    lines.append(
        f"| whole step | | | {total_floor:.2f} | {total_meas:.2f} | "
        f"{total_meas / total_floor:.1f}× |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="directory holding input.json and its systems")
    parser.add_argument(
        "--precision", nargs="+", choices=["float64", "float32"], default=["float64", "float32"]
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--frame", type=int, default=0)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    results = [run(os.path.abspath(args.data), p, args.steps, args.frame) for p in args.precision]
    print(f"load average {load:.1f} / {os.getloadavg()[0]:.1f}")
    for r in results:
        print()
        print(table(r))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
