"""Systems in memory with the parts of ``mdtrain.data.System`` the statistics use: random
water-like frames with energies, for the statistics tests."""

from __future__ import annotations

import numpy as np

from tests.helpers.models import triclinic, water_like


class FakeSystem:
    """The parts of mdtrain.data.System that statistics use."""

    def __init__(self, coord, box, atype, energy=None, path="fake"):
        self.coord, self.box, self.atype, self.energy = coord, box, atype, energy
        self.path, self.natoms, self.nframes = path, len(atype), len(coord)
        self.periodic = box is not None

    def has(self, label: str) -> bool:
        return label == "energy" and self.energy is not None

    def frames(self, indices, labels=None, positions=True) -> dict[str, np.ndarray]:
        out = {"coord": self.coord[indices]} if positions else {}
        if self.box is not None and positions:
            out["box"] = self.box[indices]
        if self.energy is not None:
            out["energy"] = self.energy[indices]
        return out


def make_system(nmol, periodic, nframes, seed, bias=(-5.0, -1.0), path="sys", retype=0):
    """Random water-like frames; ``retype`` O atoms relabelled H to vary the composition."""
    rng = np.random.default_rng(seed)
    box = triclinic(4.0 + nmol * 0.3, seed) if periodic else None
    coords = []
    for f in range(nframes):
        coord, atype = water_like(nmol, box, seed=seed * 100 + f)
        coords.append(coord)
    atype = atype.copy()
    atype[:retype] = 1
    counts = np.bincount(atype, minlength=2)
    energy = counts @ np.array(bias) + rng.normal(scale=0.01, size=nframes)
    boxes = None if box is None else np.repeat(box[None], nframes, axis=0)
    return FakeSystem(np.array(coords), boxes, atype, energy, path=path)
