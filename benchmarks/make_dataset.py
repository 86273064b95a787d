"""Write a large synthetic labelled data set (deepmd/npy folders or one deepmd/hdf5 file) for
the scale benchmarks, fast and reproducibly.

    python benchmarks/make_dataset.py OUTPUT [--systems N] [--frames F] [--size-gb G]
        [--atoms MIN MAX] [--set-size S] [--seed S] [--format npy|hdf5] [--json FILE]

``OUTPUT`` is a directory (one ``sys.NNNNNN`` folder per system; give the directory itself as a
``systems`` entry) or a ``.h5``/``.hdf5`` file (one group per system). Frames and labels come
from `lattice_data`: atoms on a jittered, strained grid (never closer than about 1.6 Å),
energies, forces and virials of a smooth Morse pair potential (consistent derivatives), in
systems of ``--atoms`` MIN..MAX atoms of one to three elements (``Al Cu Ni``). Labels are
computed for many frames at once (about 35 MB/s of output per core for 192-atom frames) and
written as they are made, so memory stays small whatever the size.

Sizes: ``--systems`` and ``--frames`` (per system) give the shape directly. With
``--size-gb``, the float64 arrays total about that many gigabytes: the frames per system are
derived from ``--systems`` (default 10), or, when ``--frames`` is given instead, the number of
systems. System ``i`` (its size, elements, grid) depends only on ``--seed`` and ``i``, so two
data sets with the same seed and systems but different frame counts share their systems.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
from lattice_data import TYPE_MAP, SystemSpec, frame_bytes, generate_frames, system_spec

_ATOMS_PER_CHUNK = 1 << 16  # frames are made and written in chunks of about this many sites
_NAMES = ("coord", "box", "energy", "force", "virial")


def _widths(natoms: int) -> dict[str, int]:
    return {"coord": 3 * natoms, "box": 9, "energy": 1, "force": 3 * natoms, "virial": 9}


def plan(
    systems: int | None,
    frames: int | None,
    size_gb: float | None,
    atoms: tuple[int, int],
    seed: int,
) -> tuple[list[SystemSpec], int]:
    """The systems and the frames per system that the options ask for."""
    if size_gb is None:
        nsys, nframes = systems or 10, frames or 100
        return [system_spec(seed, i, atoms) for i in range(nsys)], nframes
    target = size_gb * 1e9
    if systems is not None and frames is not None:
        raise SystemExit("--size-gb takes --systems or --frames, not both")
    if frames is not None:  # add systems until the target is reached
        specs: list[SystemSpec] = []
        total = 0
        while total < target:
            specs.append(system_spec(seed, len(specs), atoms))
            total += frames * frame_bytes(specs[-1].natoms)
        return specs, frames
    specs = [system_spec(seed, i, atoms) for i in range(systems or 10)]
    per_frame = sum(frame_bytes(s.natoms) for s in specs)
    return specs, max(1, math.ceil(target / per_frame))


def _chunks(nframes: int, natoms: int) -> list[tuple[int, int]]:
    step = max(1, min(1024, _ATOMS_PER_CHUNK // max(natoms, 1)))
    return [(a, min(a + step, nframes)) for a in range(0, nframes, step)]


def system_frames(spec: SystemSpec, nframes: int, seed: int):
    """Yield ``(start, arrays)`` chunks of the system's frames, arrays as stored (float64,
    ``(n, values per frame)``); the frames depend on the seed, the system and the count."""
    rng = np.random.default_rng([seed, 2, spec.index])
    for start, stop in _chunks(nframes, spec.side**3):
        data = generate_frames(spec, rng, stop - start)
        n = stop - start
        yield start, {name: data[name].reshape(n, -1) for name in _NAMES}


def _set_ranges(nframes: int, set_size: int) -> list[tuple[str, int, int]]:
    return [
        (f"set.{k:03d}", a, min(a + set_size, nframes))
        for k, a in enumerate(range(0, nframes, set_size))
    ]


class _NpyWriter:
    """One system folder: ``.npy`` files written chunk by chunk (header first, then rows)."""

    def __init__(self, path: str, spec: SystemSpec, nframes: int, set_size: int):
        os.makedirs(path)
        with open(os.path.join(path, "type.raw"), "w") as handle:
            handle.write("\n".join(str(int(t)) for t in spec.types) + "\n")
        with open(os.path.join(path, "type_map.raw"), "w") as handle:
            handle.write("\n".join(spec.elements) + "\n")
        self.path, self.widths = path, _widths(spec.natoms)
        self.sets = _set_ranges(nframes, set_size)
        self.files: dict[str, object] = {}
        self.current = -1

    def _open_set(self, k: int) -> None:
        self.close()
        name, start, stop = self.sets[k]
        os.makedirs(os.path.join(self.path, name))
        for array, width in self.widths.items():
            handle = open(os.path.join(self.path, name, array + ".npy"), "wb")  # noqa: SIM115 (closed by close())
            shape = (stop - start,) if array == "energy" else (stop - start, width)
            header = {"descr": "<f8", "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_1_0(handle, header)
            self.files[array] = handle
        self.current = k

    def write(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        n = len(arrays["coord"])
        done = 0
        while done < n:
            k = next(i for i, (_, a, b) in enumerate(self.sets) if a <= start + done < b)
            if k != self.current:
                self._open_set(k)
            take = min(n - done, self.sets[k][2] - (start + done))
            for name, handle in self.files.items():
                rows = np.ascontiguousarray(arrays[name][done : done + take], dtype="<f8")
                handle.write(rows.tobytes())
            done += take

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()
        self.files = {}


def _write_h5_system(handle, group: str, spec: SystemSpec, nframes: int, set_size: int, seed):
    g = handle.create_group(group)
    g.create_dataset("type.raw", data=np.asarray(spec.types, dtype=np.int64))
    g.create_dataset("type_map.raw", data=np.array(spec.elements, dtype="S"))
    datasets = {}
    for name, start, stop in _set_ranges(nframes, set_size):
        s = g.create_group(name)
        for array, width in _widths(spec.natoms).items():
            shape = (stop - start,) if array == "energy" else (stop - start, width)
            datasets[(name, array)] = (s.create_dataset(array + ".npy", shape, "<f8"), start)
    sets = _set_ranges(nframes, set_size)
    for start, arrays in system_frames(spec, nframes, seed):
        n = len(arrays["coord"])
        for name, a, b in sets:
            lo, hi = max(a, start), min(b, start + n)
            if lo >= hi:
                continue
            for array, values in arrays.items():
                dataset, first = datasets[(name, array)]
                rows = values[lo - start : hi - start]
                dataset[lo - first : hi - first] = rows[:, 0] if array == "energy" else rows


def write_dataset(
    output: str, specs: list[SystemSpec], nframes: int, set_size: int, seed: int, fmt: str
) -> list[str]:
    """Write every system; returns their names (folders or groups) in order."""
    width = max(6, len(str(len(specs) - 1)))
    names = [f"sys.{s.index:0{width}d}" for s in specs]
    if fmt == "hdf5":
        import h5py

        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with h5py.File(output, "w") as handle:
            for spec, name in zip(specs, names, strict=True):
                _write_h5_system(handle, name, spec, nframes, set_size, seed)
        return names
    os.makedirs(output, exist_ok=True)
    for spec, name in zip(specs, names, strict=True):
        writer = _NpyWriter(os.path.join(output, name), spec, nframes, set_size)
        try:
            for start, arrays in system_frames(spec, nframes, seed):
                writer.write(start, arrays)
        finally:
            writer.close()
    return names


def _disk_bytes(output: str) -> int:
    if os.path.isfile(output):
        return os.path.getsize(output)
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(output) for f in files
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="a new directory (deepmd/npy) or .h5/.hdf5 file")
    parser.add_argument("--systems", type=int, help="number of systems (default 10)")
    parser.add_argument("--frames", type=int, help="frames per system (default 100)")
    parser.add_argument("--size-gb", type=float, help="total size of the arrays, in GB")
    parser.add_argument("--atoms", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--set-size", type=int, default=5000, help="frames per set.*")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=["npy", "hdf5"], help="default: from the suffix")
    parser.add_argument("--json", help="also write a summary to this JSON file")
    args = parser.parse_args(argv)

    fmt = args.format or ("hdf5" if args.output.endswith((".h5", ".hdf5")) else "npy")
    if os.path.exists(args.output) and not (
        os.path.isdir(args.output) and not os.listdir(args.output)
    ):
        raise SystemExit(f"{args.output}: already exists")
    lo, hi = args.atoms
    if not 1 <= lo <= hi:
        raise SystemExit("--atoms MIN MAX: need 1 <= MIN <= MAX")
    for option in ("systems", "frames", "set_size"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise SystemExit(f"--{option.replace('_', '-')}: must be at least 1")
    specs, nframes = plan(args.systems, args.frames, args.size_gb, (lo, hi), args.seed)
    started = time.perf_counter()
    names = write_dataset(args.output, specs, nframes, args.set_size, args.seed, fmt)
    seconds = time.perf_counter() - started
    size = _disk_bytes(args.output)
    natoms = [s.natoms for s in specs]
    summary = {
        "output": os.path.abspath(args.output),
        "format": fmt,
        "type_map": TYPE_MAP,
        "seed": args.seed,
        "systems": len(specs),
        "frames_per_system": nframes,
        "frames": nframes * len(specs),
        "atoms_min": min(natoms),
        "atoms_max": max(natoms),
        "atoms_total": sum(natoms),
        "set_size": args.set_size,
        "bytes": size,
        "seconds": seconds,
        "names": names,
    }
    print(
        f"{args.output}: {len(specs)} systems × {nframes} frames ({min(natoms)}–{max(natoms)} "
        f"atoms, {fmt}), {size / 1e9:.3f} GB in {seconds:.1f} s ({size / 1e6 / seconds:.0f} MB/s)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=1)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
