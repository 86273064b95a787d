"""Start-up on many small periodic cells: ``mdtrain neighbor-stat`` and the time to the end of
the first training step, side by side with DeePMD-kit (and, optionally, another mdtrain
checkout), on bulk cells shorter than twice the cut-off.

    python benchmarks/small_cells.py make DATA [--systems 2000] [--frames 2] [--seed 0]
    python benchmarks/small_cells.py run DATA [--deepmd-env VENV] [--deepmd-backend pt]
        [--before /path/to/other/checkout] [--repeat 3] [--threads 1] [--json FILE]

``make`` writes ``--systems`` deepmd/npy folders under ``DATA``: conventional fcc cells
(lattice constant 3.6 Å, 4 atoms) repeated 1 to 2 times along each axis (4 to 32 atoms,
edges of 3.6 to 7.2 Å, all shorter than twice the 5 Å cut-off), slightly strained (so
triclinic), atoms displaced by up to 0.1 Å, one to three elements of ``Al Cu Ni``. Labels
are the Morse pair potential of ``lattice_data`` with its switch to 0 at 5 Å, summed by
brute force over every periodic image in reach: energies, forces (exact derivatives) and
virials.

``run`` times, in fresh processes, with ``OMP_NUM_THREADS`` and DeePMD-kit's thread
variables set to ``--threads``, in alternating rounds: ``neighbor-stat`` (whole process)
and ``train`` (the arrival of the log line of step 1 of a one-step run) of this checkout's
mdtrain, of ``--before``'s mdtrain (``PYTHONPATH`` set to it), and of DeePMD-kit
(``dp --BACKEND``). The input is ``startup.py``'s with rcut 5 Å. Reported: the median
and range over the rounds, the median CPU time (user + system) of each whole process, the
load average after every command, and the DeePMD-kit / mdtrain ratio of each round.

Before the rounds, the bytecode of each mdtrain checkout is written (``compileall``), as an
installed package has it and DeePMD-kit's has: where the environment sets
PYTHONDONTWRITEBYTECODE, a checkout without it compiles every module again in every run
(about 0.1 s of CPU per ``neighbor-stat``).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import sys
import tempfile

import numpy as np
from lattice_data import ATOM_ENERGY, STIFFNESS, TYPE_MAP, SystemSpec, _switch, pair_params
from make_dataset import _NpyWriter
from neighbor_stat import mdtrain_command, run_child
from startup import DP_STEP, MDTRAIN_STEP, THREAD_VARIABLES, _figures, write_input

RCUT = 5.0  # Å: the cut-off of the input (and of the labels)
LATTICE = 3.6  # Å: the conventional fcc cell's edge
FCC = np.array([[0.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]])
DISPLACEMENT = 0.1  # Å: largest displacement of an atom from its site
STRAIN = 0.02  # largest strain component of a frame's cell
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # "mdtrain" runs this


def system_cells(seed: int, index: int) -> tuple[tuple[int, int, int], np.ndarray, list[str]]:
    """System ``index``: its repetitions of the fcc cell, the elements of its atoms (indices
    into its own type map) and that type map (a sorted subset of TYPE_MAP)."""
    rng = np.random.default_rng([seed, 1, index])
    reps = tuple(int(n) for n in rng.integers(1, 3, size=3))
    natoms = 4 * reps[0] * reps[1] * reps[2]
    nelem = int(rng.integers(1, min(len(TYPE_MAP), natoms) + 1))
    chosen = sorted(int(t) for t in rng.choice(len(TYPE_MAP), size=nelem, replace=False))
    types = rng.integers(0, nelem, size=natoms)
    types[rng.permutation(natoms)[:nelem]] = np.arange(nelem)  # every element present
    return reps, types, [TYPE_MAP[t] for t in chosen]


def frames(reps, model_types: np.ndarray, rng: np.random.Generator, nframes: int) -> dict:
    """``nframes`` labelled frames of an fcc cell repeated ``reps`` times."""
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in reps], indexing="ij"), -1).reshape(-1, 3)
    sites = (grid[:, None, :] + FCC[None]).reshape(-1, 3) / np.asarray(reps)  # fractional
    natoms = len(sites)
    strain = rng.uniform(-STRAIN, STRAIN, size=(nframes, 3, 3))
    strain = 0.5 * (strain + strain.transpose(0, 2, 1))
    box = (LATTICE * np.diag(reps).astype(float)) @ (np.eye(3) + strain)  # rows: cell vectors
    direction = rng.normal(size=(nframes, natoms, 3))
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    kick = direction * (DISPLACEMENT * rng.uniform(size=(nframes, natoms, 1)) ** (1 / 3))
    coord = np.einsum("ai,fij->faj", sites, box) + kick
    out = {"coord": coord, "box": box, "energy": np.zeros(nframes),
           "force": np.zeros((nframes, natoms, 3)), "virial": np.zeros((nframes, 3, 3))}  # fmt: skip
    for f in range(nframes):
        energy, force, virial = morse_by_images(coord[f], box[f], model_types)
        out["energy"][f], out["force"][f], out["virial"][f] = energy, force, virial
    return out


def morse_by_images(coord: np.ndarray, box: np.ndarray, model_types: np.ndarray):
    """Energy, forces and virial of one frame: every (i, j, image) within RCUT, found by
    trying every image in reach (brute force: no neighbour search to trust)."""
    inverse_heights = np.linalg.norm(np.linalg.inv(box), axis=0)  # 1 / plane spacings
    reach = np.ceil(RCUT * inverse_heights + 1).astype(int)
    shifts = np.stack(
        np.meshgrid(*[np.arange(-m, m + 1) for m in reach], indexing="ij"), -1
    ).reshape(-1, 3)
    vec = coord[None, None, :] + (shifts @ box)[:, None, None, :] - coord[None, :, None, :]
    d = np.linalg.norm(vec, axis=-1)  # (images, i, j)
    natoms = len(coord)
    self_pair = (shifts == 0).all(axis=1)[:, None, None] & np.eye(natoms, dtype=bool)[None]
    keep = (d < RCUT) & ~self_pair
    s, i, j = np.nonzero(keep)
    v, r = vec[s, i, j], d[s, i, j]
    params = pair_params()
    ti, tj = model_types[i], model_types[j]
    eps, r0 = params["epsilon"][ti, tj], params["r0"][ti, tj]
    expf = np.exp(STIFFNESS * (1.0 - r / r0))
    morse = eps * expf * (expf - 2.0)
    dmorse = (-2.0 * STIFFNESS * eps / r0) * expf * (expf - 1.0)
    sw, dsw = _switch(r)
    energy = 0.5 * (morse * sw).sum() + ATOM_ENERGY[model_types].sum()  # each pair twice
    g = ((dmorse * sw + morse * dsw) / r)[:, None] * v  # dE/d(r_j - r_i), each pair twice
    force = np.zeros((natoms, 3))
    np.add.at(force, i, g)  # -dE/dr_i over both directions of every pair
    virial = -0.5 * np.einsum("pa,pb->ab", g, v)
    return energy, force, virial


def make(output: str, nsystems: int, nframes: int, seed: int) -> list[str]:
    """Write the systems as deepmd/npy folders under ``output``; returns their paths."""
    if os.path.exists(output) and os.listdir(output):
        raise SystemExit(f"{output}: already exists and is not empty")
    os.makedirs(output, exist_ok=True)
    paths = []
    for k in range(nsystems):
        reps, types, elements = system_cells(seed, k)
        model_types = np.array([TYPE_MAP.index(e) for e in elements])[types]
        data = frames(reps, model_types, np.random.default_rng([seed, 2, k]), nframes)
        spec = SystemSpec(k, 0, LATTICE, np.arange(len(types)), types, elements)
        path = os.path.join(output, f"sys.{k:06d}")
        writer = _NpyWriter(path, spec, nframes, nframes)
        try:
            writer.write(0, {name: value.reshape(nframes, -1) for name, value in data.items()})
        finally:
            writer.close()
        paths.append(path)
    return paths


def measure(data: str, deepmd_env: str | None, backend: str, before: str | None, env: dict,
            commands: tuple[str, ...] = ("neighbor-stat", "train")):  # fmt: skip
    """One round: each program's neighbor-stat and one-step training (``commands``), in a
    fresh folder."""
    folder = tempfile.mkdtemp(prefix="small_cells_")
    try:
        inp = write_input(data, folder, rcut=RCUT)
        programs = {"mdtrain": (mdtrain_command(), {**env, "PYTHONPATH": CHECKOUT})}
        if before:
            programs["before"] = (mdtrain_command(), {**env, "PYTHONPATH": before})
        out = {}
        for name, (command, child_env) in programs.items():
            if "neighbor-stat" in commands:
                stat = [*command, "neighbor-stat", inp, "-o", f"{name}.json"]
                out[f"{name} neighbor-stat"] = _timed(stat, child_env, folder)
            if "train" in commands:
                train = [*command, "train", inp, "-o", f"{name}_out"]
                out[f"{name} train"] = _timed(train, child_env, folder, MDTRAIN_STEP)
        if deepmd_env:
            dp = [os.path.join(deepmd_env, "bin", "dp"), f"--{backend}"]
            stat = [*dp, "neighbor-stat", "-s", os.path.abspath(data), "-r", str(RCUT)]
            if "neighbor-stat" in commands:
                out["dp neighbor-stat"] = _timed([*stat, "-t", *TYPE_MAP], env, folder)
            if "train" in commands:
                out["dp train"] = _timed([*dp, "train", inp], env, folder, DP_STEP)
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _timed(command: list[str], env: dict, folder: str, step=None) -> dict:
    run = run_child(command, env, folder)
    figures = _figures(run, step)
    figures["load"] = os.getloadavg()[0]
    if step is MDTRAIN_STEP:  # mdtrain's log lines and their arrival: where the time went
        figures["log"] = [(round(t, 3), line) for t, line in run.lines if "INFO" in line]
    return figures


def _summary(rounds: list[dict]) -> dict:
    """Per command: the median and the range over the rounds of its main figure."""
    out = {}
    for command in rounds[0]:
        key = "first_step_s" if "first_step_s" in rounds[0][command] else "wall_s"
        values = [r[command][key] for r in rounds]
        loads = [r[command]["load"] for r in rounds]
        cpu = statistics.median(r[command]["cpu_s"] for r in rounds)
        out[command] = {"key": key, "median": statistics.median(values), "min": min(values),
                        "max": max(values), "cpu_s": cpu, "load": [min(loads), max(loads)]}  # fmt: skip
    return out


def _ratios(rounds: list[dict], what: str, program: str) -> list[float]:
    return [r[f"dp {what}"][k] / r[f"{program} {what}"][k] for r in rounds
            for k in ["first_step_s" if what == "train" else "wall_s"]]  # fmt: skip


def run(args) -> int:
    for checkout in [CHECKOUT] + ([args.before] if args.before else []):
        compileall.compile_dir(os.path.join(checkout, "mdtrain"), quiet=2)
    env = dict(os.environ)
    env.update({name: str(args.threads) for name in THREAD_VARIABLES})
    rounds = []
    for k in range(max(1, args.repeat)):
        rounds.append(measure(args.data, args.deepmd_env, args.deepmd_backend, args.before, env,
                              tuple(args.only or ("neighbor-stat", "train"))))  # fmt: skip
        print(f"round {k + 1}: {json.dumps(rounds[-1])}", flush=True)
    summary = _summary(rounds)
    print(f"\nthreads {args.threads}; medians of {len(rounds)} rounds (range); seconds; "
          "load average (1 min) at the end of each command, lowest–highest\n")  # fmt: skip
    print("| command | figure | median (range) | CPU of the whole process | load |")
    print("| --- | --- | --- | --- | --- |")
    for command, s in summary.items():
        figure = "end of step 1" if s["key"] == "first_step_s" else "whole process"
        print(f"| {command} | {figure} | {s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f}) | "
              f"{s['cpu_s']:.2f} | {s['load'][0]:.1f}–{s['load'][1]:.1f} |")  # fmt: skip
    if args.deepmd_env:
        programs = ["mdtrain"] + (["before"] if args.before else [])
        print("\n| DeePMD-kit / | command | median ratio (range) |\n| --- | --- | --- |")
        for program in programs:
            for what in args.only or ("neighbor-stat", "train"):
                ratios = _ratios(rounds, what, program)
                print(f"| {program} | {what} | {statistics.median(ratios):.1f}× "
                      f"({min(ratios):.1f}–{max(ratios):.1f}) |")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"threads": args.threads, "rounds": rounds, "summary": summary}, handle,
                      indent=1)  # fmt: skip
            handle.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    mk = sub.add_parser("make", help="write the data set")
    mk.add_argument("data")
    mk.add_argument("--systems", type=int, default=2000)
    mk.add_argument("--frames", type=int, default=2)
    mk.add_argument("--seed", type=int, default=0)
    rn = sub.add_parser("run", help="time the commands")
    rn.add_argument("data")
    rn.add_argument("--deepmd-env", help="virtual environment of a DeePMD-kit install")
    rn.add_argument("--deepmd-backend", default="pt", choices=["tf", "pt", "jax"])
    rn.add_argument("--before", help="another mdtrain checkout to time (PYTHONPATH)")
    rn.add_argument("--repeat", type=int, default=3)
    rn.add_argument("--threads", type=int, default=1)
    rn.add_argument("--json", help="also write every figure to this JSON file")
    rn.add_argument("--only", nargs="+", choices=["neighbor-stat", "train"],
                    help="time these commands only (default: both)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.action == "make":
        if args.systems < 1 or args.frames < 1:
            raise SystemExit("--systems and --frames must be at least 1")
        paths = make(args.data, args.systems, args.frames, args.seed)
        print(f"{args.data}: {len(paths)} systems × {args.frames} frames")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
