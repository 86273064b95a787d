"""Anonymous memory of a training process against the size of its data set: the same systems
with N and factor × N frames, as deepmd/npy folders and packed into one HDF5 file.

    python benchmarks/memory_scaling.py --work /tmp/scale_data [--small-gb 0.4] [--factor 10]
        [--systems 8] [--atoms 32 192] [--steps 30] [--forms npy hdf5] [--keep] [--json FILE]

Writes the two data sets with ``benchmarks/make_dataset.py`` (same seed and systems, frames
× ``--factor``) and packs each with ``mdtrain convert --pack`` (no compression), unless they
are already in ``--work``; then runs ``mdtrain train`` for ``--steps`` steps on each (a fresh
process each, the whole pipeline: checks, neighbour statistics over every frame, descriptor
statistics and energy bias from ``data_stat_nbatch`` batches, training). Reported per run:

- ``RssAnon`` (anonymous resident memory: the heap, not the memory-mapped ``.npy`` files nor
  the page cache) read by the training process itself from ``/proc/self/status`` when the run
  has finished, and the largest value the parent saw while sampling it every 0.1 s;
- ``VmHWM`` (peak resident memory, memory-mapped files included) and the wall time, with the
  time at which the training loop started (the log line "training for N steps").

The goal: the final RssAnon of the large set exceeds the small set's by less than 100 MB in
each form. The data sets are deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

from neighbor_stat import mdtrain_command

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = {
    "type_map": ["Al", "Cu", "Ni"],
    "descriptor": {
        "type": "se_e2_a",
        "sel": "auto",
        "rcut": 6.0,
        "rcut_smth": 0.5,
        "neuron": [25, 50, 100],
        "axis_neuron": 16,
        "seed": 1,
    },
    "fitting_net": {"neuron": [240, 240, 240], "seed": 1},
}
_CHILD = """
import json, sys
from mdtrain.cli import main
code = main(["train", sys.argv[1], "-o", sys.argv[2]])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("MEMORY " + json.dumps({k: int(status[k].split()[0]) for k in
      ("RssAnon", "RssFile", "VmHWM", "VmRSS")}), flush=True)
sys.exit(code)
"""


def make_input(systems: str, steps: int, path: str) -> None:
    config = {
        "model": MODEL,
        "learning_rate": {"type": "exp", "start_lr": 1e-3, "stop_lr": 1e-5, "decay_steps": 100},
        "loss": {
            "type": "ener",
            "start_pref_e": 0.02,
            "limit_pref_e": 1,
            "start_pref_f": 1000,
            "limit_pref_f": 1,
        },
        "training": {
            "training_data": {"systems": [systems], "batch_size": "auto"},
            "numb_steps": steps,
            "seed": 1,
            "disp_freq": max(1, steps // 3),
            "save_freq": 10 * steps,
        },
    }
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=1)


def _rss_anon_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def run_training(input_path: str, out_dir: str) -> dict:
    """One ``mdtrain train`` in a child; its own final memory, the sampled peak, the times."""
    shutil.rmtree(out_dir, ignore_errors=True)
    env = dict(os.environ)
    command = [sys.executable, "-c", _CHILD, input_path, out_dir]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            value = _rss_anon_kib(proc.pid)
            if value:
                peak[0] = max(peak[0], value)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines, memory, first_step = [], None, None
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        lines.append(line)
        if line.startswith("MEMORY "):
            memory = json.loads(line[7:])
        elif first_step is None and re.search(r"training for \d+ steps", line):
            first_step = time.perf_counter() - started
    proc.wait()
    wall = time.perf_counter() - started
    sampler.join()
    if proc.returncode != 0 or memory is None:
        tail = "\n".join(lines[-20:])
        raise SystemExit(f"training failed (exit {proc.returncode}):\n{tail}")
    return {
        "rss_anon_mib": memory["RssAnon"] / 1024,
        "rss_anon_peak_mib": max(peak[0], memory["RssAnon"]) / 1024,
        "rss_file_mib": memory["RssFile"] / 1024,
        "vm_hwm_mib": memory["VmHWM"] / 1024,
        "wall_s": wall,
        "first_step_s": first_step,
    }


def ensure_data(work: str, small_gb: float, factor: int, systems: int, atoms, seed: int) -> dict:
    """The two npy sets and their packed files (made when missing); their paths and sizes."""
    small = os.path.join(work, "npy_small")
    large = os.path.join(work, "npy_large")
    made = {}
    for name, path, sizing in (
        ("small", small, ["--size-gb", str(small_gb)]),
        ("large", large, None),
    ):
        summary = path + ".json"
        if not os.path.exists(summary):
            if sizing is None:
                with open(small + ".json", encoding="utf-8") as handle:
                    frames = json.load(handle)["frames_per_system"] * factor
                sizing = ["--frames", str(frames)]
            shutil.rmtree(path, ignore_errors=True)
            command = [sys.executable, os.path.join(HERE, "make_dataset.py"), path,
                       "--systems", str(systems), "--atoms", str(atoms[0]), str(atoms[1]),
                       "--seed", str(seed), "--json", summary, *sizing]  # fmt: skip
            subprocess.run(command, check=True)
        packed = path + ".h5"
        if not os.path.exists(packed):
            command = [*mdtrain_command(), "convert", "--pack", path, "-o", packed]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(summary, encoding="utf-8") as handle:
            info = json.load(handle)
        made[name] = {"npy": path, "hdf5": packed, "bytes": info["bytes"],
                      "frames": info["frames"], "systems": info["systems"]}  # fmt: skip
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="where the data sets go (GBs)")
    parser.add_argument("--small-gb", type=float, default=0.4)
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--atoms", type=int, nargs=2, default=[32, 192])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--forms", nargs="+", default=["npy", "hdf5"])
    parser.add_argument("--keep", action="store_true", help="keep the data sets")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    os.makedirs(args.work, exist_ok=True)
    data = ensure_data(args.work, args.small_gb, args.factor, args.systems, args.atoms, args.seed)
    results: dict = {"data": data, "runs": {}}
    try:
        for form in args.forms:
            for size in ("small", "large"):
                inp = os.path.join(args.work, f"input_{form}_{size}.json")
                make_input(data[size][form], args.steps, inp)
                run = run_training(inp, os.path.join(args.work, f"out_{form}_{size}"))
                results["runs"][f"{form} {size}"] = run
                print(f"{form} {size}: {json.dumps(run)}", flush=True)
    finally:
        if not args.keep:
            for size in ("small", "large"):
                for form in ("npy", "hdf5"):
                    path = data[size][form]
                    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else None
                    if os.path.isfile(path):
                        os.remove(path)
    print()
    print("| form | data (GB) | frames | RssAnon at the end (MiB) | RssAnon peak (MiB) | "
          "VmHWM (MiB) | loop starts (s) | whole run (s) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for form in args.forms:
        for size in ("small", "large"):
            run = results["runs"][f"{form} {size}"]
            print(f"| {form} | {data[size]['bytes'] / 1e9:.2f} | {data[size]['frames']} | "
                  f"{run['rss_anon_mib']:.0f} | {run['rss_anon_peak_mib']:.0f} | "
                  f"{run['vm_hwm_mib']:.0f} | {run['first_step_s'] or float('nan'):.1f} | "
                  f"{run['wall_s']:.1f} |")  # fmt: skip
        growth = results["runs"][f"{form} large"]["rss_anon_mib"] - results["runs"][
            f"{form} small"]["rss_anon_mib"]  # fmt: skip
        results[f"growth_{form}_mib"] = growth
        print(f"\n{form}: RssAnon grows by {growth:.0f} MiB (goal: < 100 MB)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
