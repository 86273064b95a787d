"""Frames to evaluate (``mdtrain model-devi``): deepmd systems, or trajectories that ASE or
dpdata reads (extxyz, LAMMPS dumps, OUTCAR, ...).

A trajectory is read through ``mdtrain.data.readers`` (the readers of ``mdtrain convert``)
and cut into runs of consecutive frames with the same atoms; each run is a
``TrajectoryFrames``, which offers what evaluation uses of a ``System`` (``path``,
``natoms``, ``nframes``, ``periodic``, ``atype``, ``atom_order``, ``frames``) and keeps the
atoms in the file's order. LAMMPS dump types are named by ``dump_type_map`` (type 1 is its
first name); the dump's ``ITEM: TIMESTEP`` values are kept as ``timesteps``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mdtrain.data.expand import expand_systems
from mdtrain.data.mixed import open_all
from mdtrain.data.readers import Block, read_blocks, resolve_format
from mdtrain.data.system import System
from mdtrain.errors import MDTrainError

LAMMPS_DUMP = "lammps/dump"


@dataclass
class TrajectoryFrames:
    """Consecutive frames of one trajectory file with fixed atoms, in memory.

    ``first`` is the index of the run's first frame in the file; ``timesteps`` the MD steps
    of the run's frames when the file records them (LAMMPS dumps), else None.
    """

    path: str
    atype: np.ndarray  # (natoms,) model types, file order
    coord: np.ndarray  # (nframes, natoms, 3)
    box: np.ndarray | None  # (nframes, 3, 3) or None (non-periodic)
    first: int = 0
    timesteps: np.ndarray | None = None

    @property
    def natoms(self) -> int:
        return int(self.atype.size)

    @property
    def nframes(self) -> int:
        return int(self.coord.shape[0])

    @property
    def periodic(self) -> bool:
        return self.box is not None

    @property
    def atom_order(self) -> np.ndarray:
        """The atoms are kept in the file's order."""
        return np.arange(self.natoms, dtype=np.int64)

    def frames(self, indices) -> dict[str, np.ndarray]:
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = {"coord": self.coord[index]}
        if self.box is not None:
            out["box"] = self.box[index]
        return out


def open_frame_sources(
    inputs: list[str],
    type_map: list[str],
    fmt: str = "auto",
    dump_type_map: list[str] | None = None,
) -> list[System | TrajectoryFrames]:
    """The frames of every input, in order: a deepmd/npy directory (a parent folder expands
    to the systems below it) or HDF5 file gives its systems; any other file the runs of
    frames that ASE or dpdata reads from it (format ``fmt``, as ``mdtrain convert -f``).
    ``type_map`` is the model's: every element must be in it."""
    sources: list[System | TrajectoryFrames] = []
    for path in inputs:
        reader, name = resolve_format(path, fmt)
        if reader == "deepmd":
            sources += open_all(expand_systems([path], os.getcwd()), type_map)
        else:
            sources += read_trajectory(path, fmt, type_map, dump_type_map)
    return sources


def read_trajectory(
    path: str, fmt: str, type_map: list[str], dump_type_map: list[str] | None = None
) -> list[TrajectoryFrames]:
    """The runs of frames with fixed atoms in one trajectory file."""
    _, name = resolve_format(path, fmt)
    is_dump = name == LAMMPS_DUMP
    names = (dump_type_map or type_map) if is_dump else dump_type_map
    if is_dump:
        _check_dump_types(path, names, given=bool(dump_type_map))
    blocks = read_blocks(path, fmt, names)
    if not blocks:
        raise MDTrainError(f"{path}: no frames found")
    runs = _runs(blocks)
    timesteps = lammps_dump_timesteps(path) if is_dump else None
    frames, first = [], 0
    for run in runs:
        count = sum(len(block.coord) for block in run)
        label = path if len(runs) == 1 else f"{path}[{first}:{first + count}]"
        # timesteps only where they line up with the frames read (one run, every frame)
        steps = timesteps if len(runs) == 1 and _count(timesteps) == count else None
        frames.append(_frames(label, run, type_map, first, steps))
        first += count
    return frames


def _count(values: np.ndarray | None) -> int:
    return -1 if values is None else len(values)


def _runs(blocks: list[Block]) -> list[list[Block]]:
    """Consecutive blocks with the same atoms and periodicity, joined."""
    runs: list[list[Block]] = []
    for block in blocks:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and np.array_equal(last.symbols, block.symbols)
            and (last.box is None) == (block.box is None)
        ):
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


def _frames(
    label: str, run: list[Block], type_map: list[str], first: int, steps: np.ndarray | None
) -> TrajectoryFrames:
    symbols = run[0].symbols.tolist()
    missing = sorted(set(symbols) - set(type_map))
    if missing:
        raise MDTrainError(
            f"{label}: element {', '.join(missing)} is not in the model type_map {type_map}"
            " (LAMMPS dumps: name the dump types with -t)"
        )
    atype = np.array([type_map.index(s) for s in symbols], dtype=np.int64)
    periodic = run[0].box is not None
    return TrajectoryFrames(
        path=label,
        atype=atype,
        coord=np.concatenate([block.coord for block in run]).astype(np.float64),
        box=np.concatenate([block.box for block in run]).astype(np.float64) if periodic else None,
        first=first,
        timesteps=steps,
    )


def lammps_dump_timesteps(path: str) -> np.ndarray | None:
    """The ``ITEM: TIMESTEP`` values of a LAMMPS text dump, in order (None if it has none)."""
    steps = []
    try:
        with open(path, errors="replace") as handle:
            for line in handle:
                if line.startswith("ITEM: TIMESTEP"):
                    value = handle.readline().split()
                    if not value or not value[0].lstrip("-").isdigit():
                        return None
                    steps.append(int(value[0]))
    except OSError as exc:
        raise MDTrainError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return np.array(steps, dtype=np.int64) if steps else None


def _check_dump_types(path: str, names: list[str], given: bool) -> None:
    """Every LAMMPS type number in the dump has an element in ``names`` (type 1 first)."""
    largest = lammps_dump_largest_type(path)
    if largest is None or largest <= len(names):
        return
    source = "-t" if given else "the model's type_map (no -t given)"
    missing = " ".join(f"<element of type {t}>" for t in range(len(names) + 1, largest + 1))
    raise MDTrainError(
        f"{path}: LAMMPS type {largest} has no element: {source} names types 1 to "
        f"{len(names)} ({' '.join(names)}); give one element per type, type 1 first: "
        f"-t {' '.join(names)} {missing}"
    )


def lammps_dump_largest_type(path: str) -> int | None:
    """The largest number in the ``type`` column of a LAMMPS text dump (None if none)."""
    largest, column = None, None
    try:
        with open(path, errors="replace") as handle:
            for line in handle:
                if line.startswith("ITEM:"):
                    fields = line.split()
                    atoms = line.startswith("ITEM: ATOMS") and "type" in fields[2:]
                    column = fields[2:].index("type") if atoms else None
                    continue
                if column is None:
                    continue
                values = line.split()
                if len(values) > column and values[column].isdigit():
                    largest = max(largest or 0, int(values[column]))
    except OSError as exc:
        raise MDTrainError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return largest
