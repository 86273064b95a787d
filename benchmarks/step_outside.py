"""CPU and wall time of the training step's parts outside the model's nodes, as the mdtrain on
``PYTHONPATH`` makes them: the parameter update after the backward (``Trainer.
apply_gradients``: Adam), the loss's forward and backward on one batch's predictions, the
batch (``Trainer._batch``, lists cached), the model's pair vectors (``model.pair_vectors``),
a sampler draw and ``zero_grad``.

    PYTHONPATH=<tree> python benchmarks/step_outside.py /path/to/water-dft \\
        [--precision float32] [--threads 1] [--calls 200] [--rounds 7]

A Trainer is set up as ``benchmarks/train_step.py`` does and takes three real steps (the
gradients and moments are then a real step's); the update then runs at a learning rate of
1e-12, ``--calls`` times per round. Printed per part: the smallest per-call CPU and wall time
over ``--rounds`` rounds (the least disturbed by other work on the machine). To compare two
trees, run this alternately with each one's ``PYTHONPATH``.

``--in-step N`` times instead the parts inside N real training steps (after 10 warm-up
steps): the CPU time of the training thread in each part (``time.thread_time``), per step,
whatever of them the tree has: the sampler's draws, the lookahead of the coming batches and
the list prefetcher's plan, the batch, the pair vectors, the environment's pair plan, the
loss's forward, the update. A part alone, called again and again, finds its code and data
in the caches; inside a step, after the model's passes over megabytes, it costs two to four
times as much.

``--paired-glue N`` (this tree) times N pairs of whole steps, issue 27's "glue" changes
off and on in turn (the virial a loss does not read, the loss's node, davg/dstd kept).

``--paired-steps N`` (a tree with ``mdtrain.train.adam_step``) times instead N pairs of whole
training steps in one process, the update of one step of each pair through ``AdamSteps`` (the
fused kernel called directly) and of the other through ``step_together`` (torch's
``Adam.step``), in turn, and prints the medians and the median of the pairs' differences.
``--paired-vectors N`` (a tree with ``mdtrain.model.accel.pair_vectors``) does the same with
the pair vectors of one step of each pair in torch (``conservative.pair_vectors``) and of
the other compiled.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _best(function, calls: int, rounds: int) -> tuple[float, float]:
    """The smallest per-call (CPU, wall) time over ``rounds`` rounds of ``calls`` calls, us."""
    runs = []
    for _ in range(rounds):
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(calls):
            function()
        runs.append((time.process_time() - cpu, time.perf_counter() - wall))
    return min(c for c, _ in runs) / calls * 1e6, min(w for _, w in runs) / calls * 1e6


def _paired(trainer, pairs: int, precision: str, threads: int, vectors: bool = False) -> None:
    """Whole steps in turn with the direct fused update and with torch's ``Adam.step``
    (``vectors``: with the compiled pair vectors and with torch's)."""
    import statistics

    from mdtrain.train.optimizer import step_together

    class TorchStep:  # torch's Adam.step, where the Trainer calls AdamSteps.step
        @staticmethod
        def step() -> None:
            step_together([member.optimizer for member in trainer.members])

    direct, model = trainer.adam, trainer.members[0].model
    compiled = getattr(model, "vectors", None)
    if vectors and compiled is None:
        raise SystemExit("--paired-vectors: this model has no compiled pair vectors")
    times: dict[str, list[tuple[float, float]]] = {"torch": [], "direct": []}
    for step in range(3, 3 + 2 * pairs):
        which = "direct" if step % 2 else "torch"
        if vectors:
            model.vectors = compiled if which == "direct" else None
        else:
            trainer.adam = direct if which == "direct" else TorchStep
        cpu, wall = time.process_time(), time.perf_counter()
        trainer.train_step(trainer.lr.value(step))
        times[which].append((time.process_time() - cpu, time.perf_counter() - wall))
    line = [f"{precision}, {threads} thread(s), {pairs} pairs, load {os.getloadavg()[0]:.1f}:"]
    for which, runs in times.items():
        cpu_ms = statistics.median(c for c, _ in runs) * 1e3
        wall_ms = statistics.median(w for _, w in runs) * 1e3
        line.append(f"{which} {cpu_ms:.2f} ms CPU {wall_ms:.2f} ms wall;")
    gain = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(times["torch"], times["direct"])]
    line.append(
        f"median of the pairs' differences {statistics.median(c for c, _ in gain) * 1e3:.3f} "
        f"ms CPU {statistics.median(w for _, w in gain) * 1e3:.3f} ms wall"
    )
    print(" ".join(line))


def _paired_glue(trainer, pairs: int, precision: str, threads: int) -> None:
    """Whole steps in turn without and with the serial work issue 27's "glue" pass removed:
    the virial of a step whose loss does not read it (``ExplicitEnergyModel.
    virial_in_training``), the loss's operations instead of its node (``EnergyLoss._fused``)
    and davg/dstd converted at every step instead of kept (``environment_node.
    normalisation``). Main-thread CPU, process CPU and wall per step."""
    import statistics

    from mdtrain.model.accel import environment_node, explicit_descriptor, pair_kernels

    kept = environment_node.normalisation

    def fresh(desc):  # the conversions and the division of every step, as before
        return environment_node._normalised(desc.davg, desc.dstd, desc.dtype, ())

    member = trainer.members[0]
    times: dict[str, list[tuple[float, float, float]]] = {"old": [], "new": []}
    for pair in range(pairs):
        for which in ("old", "new") if pair % 2 else ("new", "old"):
            new = which == "new"
            member.model.virial_in_training = not new
            member.loss._fused.update(dict.fromkeys(member.loss._fused, new))
            explicit_descriptor.normalisation = pair_kernels.normalisation = kept if new else fresh
            thread, cpu, wall = time.thread_time(), time.process_time(), time.perf_counter()
            trainer.train_step(trainer.lr.value(3 + 2 * pair))
            times[which].append(
                (time.thread_time() - thread, time.process_time() - cpu,
                 time.perf_counter() - wall)
            )  # fmt: skip
    line = [f"{precision}, {threads} thread(s), {pairs} pairs, load {os.getloadavg()[0]:.1f}:"]
    for k, name in enumerate(("main-thread CPU", "process CPU", "wall")):
        old = [t[k] for t in times["old"]]
        new = [t[k] for t in times["new"]]
        gain = statistics.median(a - b for a, b in zip(old, new)) * 1e3
        line.append(
            f"{name} {statistics.median(old) * 1e3:.2f} -> {statistics.median(new) * 1e3:.2f}"
            f" ms (median of the pairs' differences {gain:.3f} ms);"
        )
    print(" ".join(line))


# (module, attribute path, label) of the parts ``--in-step`` times, where the tree has them
_PARTS = (
    ("mdtrain.train.sampler", "TrainingSampler.next_batch", "sampler draws"),
    ("mdtrain.train.prefetch", "Lookahead.batches", "lookahead"),
    ("mdtrain.train.prefetch", "ListPrefetcher.plan", "prefetch plan"),
    ("mdtrain.train.loop", "make_batch", "batch"),
    ("mdtrain.model.accel.explicit", "ExplicitEnergyModel.pair_vectors", "pair vectors"),
    ("mdtrain.model.accel.explicit_descriptor", "pair_plan", "pair plan"),
    ("mdtrain.train.loss", "EnergyLoss.__call__", "loss forward"),
    ("mdtrain.train.loop", "Trainer.apply_gradients", "update"),
)


def _in_step(trainer, steps: int) -> dict[str, float]:
    """CPU us of the training thread per step in each part of ``_PARTS``, over ``steps``
    steps after 10 (the parts wrapped in place: run last)."""
    import functools
    import importlib

    spent: dict[str, float] = {}

    def timed(function, label):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - start

        return wrapper

    for module, path, label in _PARTS:
        owner = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, name):
            setattr(owner, name, timed(getattr(owner, name), label))
    for step in range(10 + steps):
        if step == 10:
            spent.clear()
        trainer.train_step(trainer.lr.value(step))
    return {label: spent.get(label, 0.0) / steps * 1e6 for _, _, label in _PARTS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", help="an input.json, or a directory holding one")
    parser.add_argument("--precision", default="float32", choices=("float32", "float64"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--paired-steps", type=int, default=0)
    parser.add_argument("--paired-vectors", type=int, default=0)
    parser.add_argument("--in-step", type=int, default=0)
    parser.add_argument("--paired-glue", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train_step

    path = args.input
    if os.path.isdir(path):
        path = os.path.join(path, "input.json")
    config, data, runtime = train_step._prepared(
        path, args.precision, 13 + args.in_step + 2 * args.paired_glue, 0, args.threads, None
    )  # as many steps as the run takes: the lookahead sees the steps to come
    with tempfile.TemporaryDirectory() as out_dir:
        trainer, _, _ = train_step._trainer(config, data, runtime, 1, out_dir, False)
        for step in range(3):
            trainer.train_step(trainer.lr.value(step))
        if args.in_step:
            parts = _in_step(trainer, args.in_step)
            print(
                f"{args.precision}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}, "
                "CPU us per step inside the step: "
                + "; ".join(f"{label} {value:.0f}" for label, value in parts.items())
            )
            return
        if args.paired_glue:
            _paired_glue(trainer, args.paired_glue, args.precision, args.threads)
            return
        if args.paired_steps or args.paired_vectors:
            pairs = args.paired_vectors or args.paired_steps
            _paired(trainer, pairs, args.precision, args.threads, bool(args.paired_vectors))
            return
        for member in trainer.members:
            for group in member.optimizer.param_groups:
                group["lr"] = 1e-12  # the update runs many times: keep the weights
        update = _best(trainer.apply_gradients, args.calls, args.rounds)
        member = trainer.members[0]
        batch = trainer._batch(trainer.train_systems[0], [0])
        pred = {
            k: v.detach().requires_grad_(True) if v.is_floating_point() else v
            for k, v in member.model(*batch.inputs()).items()
        }

        def loss_step() -> None:
            loss, _ = member.loss(pred, batch.labels, batch.natoms, 1e-3)
            loss.backward()

        loss = _best(loss_step, args.calls, args.rounds)
        system, frames = trainer.train_systems[0], [0]
        make = _best(lambda: trainer._batch(system, frames), args.calls, args.rounds)
        coord, _, box, nlist, shift = batch.inputs()
        x, cell = coord.detach().double(), None if box is None else box.detach().double()
        vectors = _best(
            lambda: member.model.pair_vectors(x, cell, nlist, shift), args.calls, args.rounds
        )
        sampler = member.sampler.copy_ahead()
        draw = _best(sampler.next_batch, args.calls, args.rounds)
        zero = _best(lambda: member.optimizer.zero_grad(set_to_none=True), args.calls, args.rounds)
    print(
        f"{args.precision}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}: "
        f"update {update[0]:.0f} us CPU {update[1]:.0f} us wall; "
        f"loss forward+backward {loss[0]:.0f} us CPU {loss[1]:.0f} us wall; "
        f"batch {make[0]:.0f} us CPU; pair vectors {vectors[0]:.0f} us CPU; "
        f"sampler draw {draw[0]:.1f} us CPU; zero_grad {zero[0]:.1f} us CPU"
    )


if __name__ == "__main__":
    main()
