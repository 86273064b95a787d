"""Benchmark ``mdtrain neighbor-stat``: whole-process wall time, frames/s and peak memory.

    python benchmarks/neighbor_stat.py DATA_PATH [--rcut 6.0] [--type-map O H] [--repeat 3]
                                       [--json FILE]

Runs ``mdtrain neighbor-stat -s DATA_PATH -r RCUT -t TYPES...`` as a subprocess ``--repeat``
times (the console script of this interpreter, not a shell shim, so that only mdtrain's own
start-up is timed) and reports the median wall time, the median CPU time (user + system),
frames per second, the peak resident memory of the children (``RUSAGE_CHILDREN``), and the
statistics found. Timings on a machine shared with other work are noisy: compare the CPU
time as well as the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time


def mdtrain_command() -> list[str]:
    """The ``mdtrain`` console script next to this interpreter, else ``python -m mdtrain``."""
    script = os.path.join(sysconfig.get_path("scripts"), "mdtrain")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    found = shutil.which("mdtrain")
    return [found] if found else [sys.executable, "-m", "mdtrain"]


def run_once(command: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one child process; raises when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise SystemExit(f"command failed with exit code {result.returncode}: {' '.join(command)}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="system directory, .h5 file, or a directory of systems")
    parser.add_argument("--rcut", type=float, default=6.0)
    parser.add_argument("--type-map", nargs="+", default=["O", "H"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "neighbor_stat.json")
        command = [*mdtrain_command(), "neighbor-stat", "-s", args.data, "-r", str(args.rcut),
                   "-t", *args.type_map, "-o", output]  # fmt: skip
        walls, cpus = [], []
        for _ in range(max(1, args.repeat)):
            wall, cpu = run_once(command)
            walls.append(wall)
            cpus.append(cpu)
        with open(output, encoding="utf-8") as handle:
            stat = json.load(handle)

    peak_rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    nframes = sum(system["nframes"] for system in stat["systems"])
    wall = statistics.median(walls)
    figures = {
        "command": " ".join(command[:-2]),
        "systems": len(stat["systems"]),
        "frames": nframes,
        "repeat": len(walls),
        "wall_s": walls,
        "wall_median_s": wall,
        "cpu_median_s": statistics.median(cpus),
        "frames_per_s": nframes / wall,
        "peak_rss_mib": peak_rss_mib,
        "rcut": stat["rcut"],
        "type_map": stat["type_map"],
        "min_nbor_dist": stat["min_nbor_dist"],
        "max_nbor_size": stat["max_nbor_size"],
        "sel": stat["sel"],
    }
    min_dist = stat["min_nbor_dist"]
    rows = [
        ("command", figures["command"]),
        ("systems / frames", f"{len(stat['systems'])} / {nframes}"),
        ("wall time (median)", f"{wall:.3f} s  (runs: {', '.join(f'{w:.3f}' for w in walls)})"),
        ("CPU time (median)", f"{figures['cpu_median_s']:.3f} s"),
        ("frames/s", f"{figures['frames_per_s']:.0f}"),
        ("peak RSS", f"{peak_rss_mib:.1f} MiB"),
        ("min_nbor_dist", "undefined" if min_dist is None else f"{min_dist:.6f} Å"),
        ("max_nbor_size", str(stat["max_nbor_size"])),
        ("sel (auto)", str(stat["sel"])),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=2)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
