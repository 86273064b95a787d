"""Time the model on a synthetic 192-atom water-like frame (64 H2O, 12.44 Å cubic box).

Measures (median over --steps repetitions, after warm-up):
  * eval: one forward with forces and virial (model.eval(), no second-order graph);
  * train: one training-style step: forward, forces, loss on E and F, backward, Adam step.
Settings follow the DeePMD water example: sel [46, 92], rcut 6, neuron [25, 50, 100],
axis_neuron 16, fitting [240, 240, 240]. The neighbour list is built once, outside the timing.

    python benchmarks/model_step.py [--precision float64|float32] [--steps N] [--threads T]
        [--backend auto|kernels|fused|reference] [--profile] [--input INPUT_JSON]

``--input`` takes the model section of an input file instead (any descriptor; a ``sel``
"auto" is not resolved, give numbers), its precision kept unless ``--precision`` is given.

``--backend`` measures what each backend brings (``mdtrain.model.backend``): ``reference`` is
the plain model (forces by autograd.grad with create_graph and a double backward in
training, the embedding net on every slot), ``fused`` the explicit first-order derivatives
on fused PyTorch nodes, ``kernels`` the same on the compiled kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from mdtrain.memory import keep_freed_memory
from mdtrain.model.backend import BACKENDS, build_model
from mdtrain.model.stats import PairStatSums
from mdtrain.neighbors.layout import layout_of
from mdtrain.train.optimizer import make_adam

BOX = 12.44
CONFIG = {
    "type_map": ["O", "H"],
    "descriptor": {
        "type": "se_e2_a",
        "sel": [46, 92],
        "rcut": 6.0,
        "rcut_smth": 0.5,
        "neuron": [25, 50, 100],
        "axis_neuron": 16,
        "type_one_side": True,
        "resnet_dt": False,
        "seed": 1,
    },
    "fitting_net": {"neuron": [240, 240, 240], "resnet_dt": True, "seed": 1},
}


def precision_config(precision: str, config: dict | None = None) -> dict:
    """``config`` (default: ``CONFIG``) with the descriptor and fitting in ``precision``."""
    config = {**(config or CONFIG)}
    for part in ("descriptor", "fitting_net"):
        config[part] = {**config[part], "precision": precision}
    return config


def training_step(model, inputs: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """One training step of ``model`` on the frame ``inputs`` as the Trainer takes it:
    forward, forces, the energy and force loss (prefactors 0.02 and 1000), backward, Adam."""
    natoms = len(inputs[1])
    e_label = torch.tensor([-187.0 * natoms / 6])
    f_label = torch.zeros(1, natoms, 3, dtype=torch.float64)
    optimizer = make_adam(list(model.parameters()), 1e-3)  # as the Trainer

    def step() -> None:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        out = model(*inputs)
        loss = 0.02 * ((out["energy"] - e_label) ** 2).mean() / natoms
        loss = loss + 1000.0 * ((out["force"] - f_label) ** 2).mean()
        loss.backward()
        optimizer.step()

    return step


def water_box(nmol: int = 64, box: float = BOX, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random rigid H2O molecules with O–O distances ≥ 2.5 Å (minimum image); O first."""
    rng = np.random.default_rng(seed)
    oxygens: list[np.ndarray] = []
    while len(oxygens) < nmol:
        trial = rng.random(3) * box
        if oxygens:
            d = np.array(oxygens) - trial
            d -= box * np.round(d / box)
            if np.min(np.linalg.norm(d, axis=1)) < 2.5:
                continue
        oxygens.append(trial)
    hydrogens = []
    angle = np.deg2rad(104.5)
    for o in oxygens:
        u = rng.normal(size=3)
        u /= np.linalg.norm(u)
        v = rng.normal(size=3)
        v -= u * (u @ v)
        v /= np.linalg.norm(v)
        hydrogens += [o + 0.9572 * u, o + 0.9572 * (np.cos(angle) * u + np.sin(angle) * v)]
    coord = np.concatenate([np.array(oxygens), np.array(hydrogens)])
    atype = np.array([0] * nmol + [1] * (2 * nmol), dtype=np.int64)
    return coord, atype


def water_inputs(model) -> tuple[tuple[torch.Tensor, ...], np.ndarray]:
    """``water_box``'s frame as ``model``'s inputs (coord, atype, box, nlist, shift), with the
    descriptor's statistics set from it; and the neighbour counts per type."""
    coord, atype = water_box()
    box = np.eye(3) * BOX
    nlist, shift, counts = layout_of(model).build(coord, box, atype, model.rcut, model.sel)
    sums = PairStatSums.of_model(model)
    sums.add_frame(coord, box, atype)
    davg, dstd = model.descriptor.stats_from_items(sums.items())
    model.descriptor.set_stats(torch.from_numpy(davg), torch.from_numpy(dstd))
    arrays = (coord[None], atype, box[None], nlist[None], shift[None])
    return tuple(torch.tensor(a) for a in arrays), counts


def _public(value):
    """``value`` without the keys starting with "_" (comments), at every depth."""
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list):
        return [_public(v) for v in value]
    return value


def median_time(fn, steps: int, warmup: int = 2) -> tuple[float, float]:
    """Median wall time and median process CPU time (less sensitive to a busy machine)."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=["float64", "float32"])
    parser.add_argument("--input", help="take the model section of this input.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--backend",
        choices=["auto", *BACKENDS],
        default="auto",
        help="model backend (auto: the first that runs, as mdtrain train does)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="print a profiler table of a train step"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.input:
        with open(args.input, encoding="utf-8") as handle:
            config = _public(json.load(handle)["model"])
    else:
        config = {**CONFIG}
        args.precision = args.precision or "float64"
    if args.precision:
        config = precision_config(args.precision, config)
    keep_freed_memory()  # as mdtrain train does
    model = build_model(config, backend=args.backend)
    print(f"backend: {model.backend}")
    inputs, counts = water_inputs(model)
    atype, nlist = inputs[1], inputs[3]
    model.set_out_bias([-93.5, -187.0 / 2])

    def eval_step() -> None:
        model.eval()
        model(*inputs)

    train_step = training_step(model, inputs)

    real = int((nlist >= 0).sum())
    print(
        f"frame: {len(atype)} atoms, box {BOX} Å, max neighbours O/H {counts.max(axis=0).tolist()}, "
        f"{real}/{nlist.numel()} slots real ({100 * real / nlist.numel():.0f}%)"
    )
    print(
        f"precision {args.precision or 'as in the input'}, torch threads {torch.get_num_threads()}, torch {torch.__version__}"
    )
    t_eval = median_time(eval_step, args.steps)
    t_train = median_time(train_step, args.steps)
    for name, (wall, cpu) in (
        ("eval  (forward + force + virial)", t_eval),
        ("train (forward, forces, E+F loss, backward, Adam)", t_train),
    ):
        print(
            f"{name}: wall {1000 * wall:8.1f} ms, cpu {1000 * cpu:8.1f} ms (medians of {args.steps})"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        events = prof.events()
        aten = [e for e in events if e.name.startswith("aten::")]
        outer = [e for e in aten if not _inside_aten(e)]
        nodes = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
        print(
            f"per train step: {len(aten)} aten:: calls ({len(outer)} not inside another), "
            f"{len(nodes)} autograd nodes evaluated"
        )


def _inside_aten(event) -> bool:
    """Whether a profiler event runs inside another ``aten::`` call."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


if __name__ == "__main__":
    main()
