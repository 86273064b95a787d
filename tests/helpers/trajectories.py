"""Trajectory files for the tests, written by hand: LAMMPS text dumps (atoms listed in a
shuffled id order, as LAMMPS does under domain decomposition) and extended XYZ through ASE."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_lammps_dump(
    path,
    coords: np.ndarray,
    types: np.ndarray,
    boxes: np.ndarray,
    timesteps: list[int],
    seed: int = 0,
) -> str:
    """A ``dump atom custom``-style text dump: ``id type x y z``, ids 1..N in file order,
    LAMMPS type ``types[i] + 1``, orthogonal ``boxes`` (their diagonals), atoms of every
    frame listed in a random order."""
    rng = np.random.default_rng(seed)
    lines = []
    for coord, box, step in zip(coords, boxes, timesteps, strict=True):
        lines += [
            "ITEM: TIMESTEP",
            str(step),
            "ITEM: NUMBER OF ATOMS",
            str(len(types)),
            "ITEM: BOX BOUNDS pp pp pp",
        ]
        lines += [f"0.0 {box[d, d]:.12f}" for d in range(3)]
        lines.append("ITEM: ATOMS id type x y z")
        for i in rng.permutation(len(types)):
            x, y, z = coord[i]
            lines.append(f"{i + 1} {int(types[i]) + 1} {x:.12f} {y:.12f} {z:.12f}")
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)


def write_extxyz(path, coords: np.ndarray, symbols: list[list[str]], boxes) -> str:
    """Frames as extended XYZ (``boxes`` None or a None entry: non-periodic frame)."""
    import ase
    import ase.io

    images = []
    for f, coord in enumerate(coords):
        box = None if boxes is None else boxes[f]
        images.append(ase.Atoms(symbols[f], positions=coord, cell=box, pbc=box is not None))
    ase.io.write(str(path), images, format="extxyz")
    return str(path)
