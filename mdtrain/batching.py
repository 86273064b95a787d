"""Frames of one system → model-ready tensors (coordinates, neighbour lists, labels).

Neighbour lists are built here, per frame, outside autograd; the model only gathers positions
and adds image shifts. A batch never mixes systems, so every frame has the same atoms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mdtrain.data import System
from mdtrain.neighbors.nlist import build_nlist

LABELS = ("energy", "force", "virial")


@dataclass
class Batch:
    """Tensors for a batch of frames of one system; labels hold only what the system has."""

    system: str
    coord: torch.Tensor  # (nf, N, 3)
    atype: torch.Tensor  # (N,)
    box: torch.Tensor | None  # (nf, 3, 3)
    nlist: torch.Tensor  # (nf, N, nnei)
    shift: torch.Tensor  # (nf, N, nnei, 3)
    labels: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nframes(self) -> int:
        return self.coord.shape[0]

    @property
    def natoms(self) -> int:
        return self.coord.shape[1]

    def inputs(self) -> tuple:
        return self.coord, self.atype, self.box, self.nlist, self.shift

    def select(self, frames: slice) -> Batch:
        """A micro-batch: the same system, a contiguous slice of its frames."""
        return Batch(
            system=self.system,
            coord=self.coord[frames],
            atype=self.atype,
            box=None if self.box is None else self.box[frames],
            nlist=self.nlist[frames],
            shift=self.shift[frames],
            labels={k: v[frames] for k, v in self.labels.items()},
        )


def make_batch(
    system: System,
    indices: np.ndarray | list[int],
    rcut: float,
    sel: list[int],
    device: torch.device | str = "cpu",
) -> Batch:
    """Read frames ``indices`` of ``system`` and build their neighbour lists."""
    frames = system.frames(np.asarray(indices, dtype=np.int64))
    coord = frames["coord"]
    boxes = frames.get("box")
    lists, shifts = [], []
    for f in range(coord.shape[0]):
        nlist, shift, _ = build_nlist(
            coord[f], None if boxes is None else boxes[f], system.atype, rcut, sel
        )
        lists.append(nlist)
        shifts.append(shift)

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

    return Batch(
        system=system.path,
        coord=tensor(coord, torch.float64),
        atype=tensor(system.atype, torch.long),
        box=None if boxes is None else tensor(boxes, torch.float64),
        nlist=tensor(np.stack(lists), torch.long),
        shift=tensor(np.stack(shifts), torch.float64),
        labels={k: tensor(frames[k], torch.float64) for k in LABELS if k in frames},
    )
