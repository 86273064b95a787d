"""Size and read speed of a data set as deepmd/npy folders and packed into one HDF5 file
(``mdtrain convert --pack``) without compression, with lzf and with gzip.

    python benchmarks/pack_read.py DATA [--work DIR] [--compression none lzf gzip]
        [--batches 3000] [--batch-size 1] [--repeat 3] [--json FILE]

``DATA`` is a folder of deepmd/npy systems (``benchmarks/make_dataset.py`` writes one). The
packed files go to ``--work`` (default: a temporary folder, removed at the end). Reported per
form: bytes on disk, the time ``mdtrain convert --pack`` took, and in a fresh process per
form and round (alternating, so that every form sees the same load):

- scan: every frame read once through ``System.frames`` in chunks of about 64k atoms, as the
  checks and neighbour statistics read them (frames/s and MB/s of float64 arrays);
- random: ``--batches`` batches of ``--batch-size`` random frames of a random system, as
  training reads them (batches/s), after opening every system.

The files were just written, so the operating system's page cache holds them: the figures
measure decoding and library overhead, not the disk. Medians over ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from neighbor_stat import mdtrain_command, run_child


def _child(source: str, batches: int, batch_size: int) -> dict:
    """Run in a fresh process: open the systems, scan every frame, then random batches."""
    import numpy as np

    from mdtrain.data import expand_systems, open_system

    started = time.perf_counter()
    systems = [open_system(p) for p in expand_systems(source)]
    opened = time.perf_counter() - started
    frames = atoms = 0
    started = time.perf_counter()
    for system in systems:
        step = max(1, (1 << 16) // system.natoms)
        for a in range(0, system.nframes, step):
            data = system.frames(np.arange(a, min(a + step, system.nframes)))
            frames += len(data["coord"])
            atoms += data["coord"].shape[0] * system.natoms
    scan = time.perf_counter() - started
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(systems), size=batches)
    started = time.perf_counter()
    for k in picks:
        system = systems[k]
        system.frames(np.sort(rng.choice(system.nframes, batch_size, replace=False)))
    random = time.perf_counter() - started
    nbytes = 8 * (6 * atoms + 19 * frames)
    return {
        "open_s": opened,
        "scan_s": scan,
        "scan_frames_per_s": frames / scan,
        "scan_mb_per_s": nbytes / scan / 1e6,
        "random_batches_per_s": batches / random,
    }


def _disk_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", help="a folder of deepmd/npy systems")
    parser.add_argument("--work", help="where the packed files go (default: a temporary one)")
    parser.add_argument("--compression", nargs="+", default=["none", "lzf", "gzip"])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.batches, args.batch_size)))
        return 0
    if not args.data:
        parser.error("the data folder is required")

    work = args.work or tempfile.mkdtemp(prefix="pack_read_")
    os.makedirs(work, exist_ok=True)
    forms = {"folders": os.path.abspath(args.data)}
    report: dict = {"data": forms["folders"], "forms": {}}
    try:
        for compression in args.compression:
            out = os.path.join(work, f"packed-{compression}.h5")
            if os.path.exists(out):
                os.remove(out)
            command = [*mdtrain_command(), "convert", "--pack", forms["folders"], "-o", out,
                       "--compression", compression]  # fmt: skip
            run = run_child(command)
            forms[f"packed, {compression}"] = out
            report["forms"][f"packed, {compression}"] = {"pack_s": run.wall_s,
                                                         "pack_peak_rss_mib": run.peak_rss_mib}  # fmt: skip
        for name, path in forms.items():
            report["forms"].setdefault(name, {})["bytes"] = _disk_bytes(path)
        rounds: dict[str, list[dict]] = {name: [] for name in forms}
        for _ in range(max(1, args.repeat)):
            for name, path in forms.items():
                command = [sys.executable, os.path.abspath(__file__), "--child", path,
                           "--batches", str(args.batches), "--batch-size", str(args.batch_size)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                rounds[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"| form | size (MB) | pack (s) | scan (frames/s) | scan (MB/s) | random batches of "
          f"{args.batch_size} (/s) | open (s) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in forms:
        figures = report["forms"][name]
        for key in rounds[name][0]:
            values = [r[key] for r in rounds[name]]
            figures[key] = statistics.median(values)
            figures[key + "_rounds"] = values
        pack_s = figures.get("pack_s")
        print(f"| {name} | {figures['bytes'] / 1e6:.0f} | {'—' if pack_s is None else f'{pack_s:.1f}'} | "
              f"{figures['scan_frames_per_s']:.0f} | {figures['scan_mb_per_s']:.0f} | "
              f"{figures['random_batches_per_s']:.0f} | {figures['open_s']:.2f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
