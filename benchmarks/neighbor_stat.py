"""Benchmark ``mdtrain neighbor-stat``: whole-process wall time, frames/s and peak memory.

    python benchmarks/neighbor_stat.py DATA_PATH [--rcut 6.0] [--type-map O H] [--repeat 3]
                                       [--json FILE]

Runs ``mdtrain neighbor-stat -s DATA_PATH -r RCUT -t TYPES...`` as a subprocess ``--repeat``
times (the console script of this interpreter, not a shell shim, so that only mdtrain's own
start-up is timed) and reports the median wall time, the median CPU time (user + system),
frames per second, the largest peak resident memory of the runs, and the statistics found.
Timings on a machine shared with other work are noisy: compare the CPU time as well as the
wall time.

Also the process helpers of ``benchmarks/suite.py``: `run_child` times one child process
(wall, CPU and peak RSS from its own ``wait4`` record, and the arrival time of every output
line, from which the suite derives step times of training logs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field


class ChildFailed(RuntimeError):
    """A benchmarked command exited with an error; the message ends with its last lines."""


@dataclass
class ChildRun:
    """What one child process cost, and what it printed (stdout and stderr together)."""

    command: list[str]
    returncode: int
    wall_s: float
    cpu_s: float  # user + system, of the child and the descendants it waited for
    peak_rss_mib: float  # the largest single process of that tree
    lines: list[tuple[float, str]] = field(default_factory=list)  # (s after start, line)

    def tail(self, count: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-count:])


def run_child(
    command: list[str], env: dict[str, str] | None = None, cwd: str | None = None
) -> ChildRun:
    """Run ``command``, time-stamping each output line as it arrives; raise `ChildFailed`
    when it fails. Wall time from start to exit; CPU and peak RSS of this child only
    (``wait4``), so that runs in one parent do not mix."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd
    )
    lines = []
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        lines.append((time.perf_counter() - start, raw.decode(errors="replace").rstrip("\n")))
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    run = ChildRun(
        command=list(command),
        returncode=proc.returncode,
        wall_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_rss_mib=usage.ru_maxrss / 1024,  # KiB on Linux
        lines=lines,
    )
    if run.returncode != 0:
        raise ChildFailed(f"exit code {run.returncode}: {' '.join(command)}\n{run.tail()}".rstrip())
    return run


def mdtrain_command() -> list[str]:
    """The ``mdtrain`` console script next to this interpreter, else ``python -m mdtrain``."""
    script = os.path.join(sysconfig.get_path("scripts"), "mdtrain")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    found = shutil.which("mdtrain")
    return [found] if found else [sys.executable, "-m", "mdtrain"]


def mdtrain_neighbor_stat(
    data: str, rcut: float, type_map: list[str], output: str, env: dict[str, str] | None = None
) -> tuple[ChildRun, dict]:
    """One whole-process ``mdtrain neighbor-stat`` run and the JSON file it wrote."""
    command = [*mdtrain_command(), "neighbor-stat", "-s", data, "-r", str(rcut),
               "-t", *type_map, "-o", output]  # fmt: skip
    run = run_child(command, env=env)
    with open(output, encoding="utf-8") as handle:
        return run, json.load(handle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="system directory, .h5 file, or a directory of systems")
    parser.add_argument("--rcut", type=float, default=6.0)
    parser.add_argument("--type-map", nargs="+", default=["O", "H"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "neighbor_stat.json")
        for _ in range(max(1, args.repeat)):
            try:
                run, stat = mdtrain_neighbor_stat(args.data, args.rcut, args.type_map, output)
            except ChildFailed as exc:
                raise SystemExit(f"mdtrain neighbor-stat failed, {exc}") from None
            runs.append(run)

    walls = [run.wall_s for run in runs]
    peak_rss_mib = max(run.peak_rss_mib for run in runs)
    nframes = sum(system["nframes"] for system in stat["systems"])
    wall = statistics.median(walls)
    figures = {
        "command": " ".join(runs[0].command[:-2]),
        "systems": len(stat["systems"]),
        "frames": nframes,
        "repeat": len(walls),
        "wall_s": walls,
        "wall_median_s": wall,
        "cpu_median_s": statistics.median(run.cpu_s for run in runs),
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
