"""Write in-memory frames as a deepmd/npy directory or a deepmd/hdf5 group, mixed-type
(``set.*/real_atom_types.npy``) when the frames carry their own types."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np


@dataclass
class SystemData:
    """Frames of one system held in memory; ``types`` index ``type_map``."""

    types: np.ndarray  # (natoms,) int
    type_map: list[str]
    coord: np.ndarray  # (nf, natoms, 3)
    box: np.ndarray | None = None  # (nf, 3, 3); None: non-periodic
    energy: np.ndarray | None = None  # (nf,)
    force: np.ndarray | None = None  # (nf, natoms, 3)
    virial: np.ndarray | None = None  # (nf, 3, 3)
    real_types: np.ndarray | None = None  # (nf, natoms): mixed-type, -1 a virtual atom

    @property
    def nframes(self) -> int:
        return len(self.coord)

    def take(self, index: np.ndarray) -> SystemData:
        """The frames ``index`` only."""
        pick = {
            name: None if getattr(self, name) is None else getattr(self, name)[index]
            for name in ("coord", "box", "energy", "force", "virial", "real_types")
        }
        return replace(self, **pick)

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-frame arrays in the file layout: ``name -> (nf, values)`` float64."""
        nf = self.nframes
        out = {}
        for name in ("coord", "box", "energy", "force", "virial"):
            value = getattr(self, name)
            if value is not None:
                value = np.asarray(value, dtype=np.float64).reshape(nf, -1)
                out[name] = value[:, 0] if name == "energy" else value
        if self.real_types is not None:
            out["real_atom_types"] = np.asarray(self.real_types, dtype=np.int64).reshape(nf, -1)
        return out


def _set_slices(nframes: int, set_size: int) -> list[tuple[str, slice]]:
    return [
        (f"set.{k:03d}", slice(start, min(start + set_size, nframes)))
        for k, start in enumerate(range(0, nframes, set_size))
    ]


def write_npy(path: str, data: SystemData, set_size: int) -> None:
    """A deepmd/npy directory at ``path`` (created); ``nopbc`` when there is no cell."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "type.raw"), "w") as handle:
        handle.write("\n".join(str(int(t)) for t in data.types) + "\n")
    with open(os.path.join(path, "type_map.raw"), "w") as handle:
        handle.write("\n".join(data.type_map) + "\n")
    if data.box is None:
        open(os.path.join(path, "nopbc"), "w").close()
    arrays = data.arrays()
    for set_name, rows in _set_slices(data.nframes, set_size):
        os.makedirs(os.path.join(path, set_name), exist_ok=True)
        for name, values in arrays.items():
            np.save(os.path.join(path, set_name, name + ".npy"), values[rows])


def write_hdf5(handle, group: str, data: SystemData, set_size: int) -> None:
    """The same tree as ``write_npy`` as ``group`` of an open, writable ``h5py.File``."""
    g = handle.require_group(group)
    g.create_dataset("type.raw", data=np.asarray(data.types, dtype=np.int64))
    g.create_dataset("type_map.raw", data=np.array(data.type_map, dtype="S"))
    if data.box is None:
        g.create_dataset("nopbc", data=True)
    arrays = data.arrays()
    for set_name, rows in _set_slices(data.nframes, set_size):
        s = g.create_group(set_name)
        for name, values in arrays.items():
            s.create_dataset(name + ".npy", data=values[rows])
