"""Brute-force numpy references, independent of the code under test: neighbour pairs over
periodic images, per-atom neighbour blocks in the model's layout, the smooth switch of se_e2_a;
and random triclinic cells to try them on."""

from __future__ import annotations

import itertools

import numpy as np


def brute_force_pairs(coord, box, rcut):
    """Every (i, j, shift, dist) with 0 < |r_j + shift @ box - r_i| < rcut, by enumeration."""
    n = len(coord)
    if box is None:
        shifts = np.zeros((1, 3), dtype=np.int64)
    else:
        # images needed per direction: rcut over the spacing of lattice planes, plus the
        # spread of the (possibly unwrapped) fractional coordinates
        volume = abs(np.linalg.det(box))
        frac = coord @ np.linalg.inv(box)
        reach = []
        for k in range(3):
            a, b = box[(k + 1) % 3], box[(k + 2) % 3]
            spacing = volume / np.linalg.norm(np.cross(a, b))
            spread = frac[:, k].max() - frac[:, k].min()
            reach.append(int(np.ceil(rcut / spacing + spread)) + 1)
        shifts = np.array(
            list(itertools.product(*(range(-m, m + 1) for m in reach))), dtype=np.int64
        )
    rows = []
    for s in shifts:
        offset = s @ box if box is not None else np.zeros(3)
        diff = coord[None, :, :] + offset - coord[:, None, :]  # (i, j, 3)
        dist = np.linalg.norm(diff, axis=-1)
        ok = dist < rcut
        if not s.any():
            ok &= ~np.eye(n, dtype=bool)
        for i, j in zip(*np.nonzero(ok), strict=True):
            rows.append((int(i), int(j), *map(int, s), float(dist[i, j])))
    return rows


def random_cell(rng, lengths, tilt=0.3):
    """A triclinic cell (rows = cell vectors) with the given rough lengths."""
    cell = np.diag(lengths).astype(float)
    cell[1, 0] = rng.uniform(-tilt, tilt) * lengths[0]
    cell[2, 0] = rng.uniform(-tilt, tilt) * lengths[0]
    cell[2, 1] = rng.uniform(-tilt, tilt) * lengths[1]
    return cell


def ref_neighbours(coord, box, atype, rcut, sel):
    """Per atom and neighbour type: diff vectors sorted by distance, cut to sel (brute force)."""
    ntypes = len(sel)
    if box is None:
        images = [np.zeros(3)]
    else:
        inv = np.linalg.inv(box)
        reps = [int(np.ceil(rcut * np.linalg.norm(inv[:, k]))) for k in range(3)]
        images = [
            np.array(s, dtype=float) @ box
            for s in itertools.product(*[range(-n, n + 1) for n in reps])
        ]
    out = []
    for i in range(len(coord)):
        blocks = [[] for _ in range(ntypes)]
        for j in range(len(coord)):
            for img in images:
                d = coord[j] + img - coord[i]
                r = np.linalg.norm(d)
                if 1e-12 < r < rcut:
                    blocks[atype[j]].append((r, d, atype[j]))
        out.append([sorted(b, key=lambda x: x[0])[: sel[t]] for t, b in enumerate(blocks)])
    return out


def ref_switch(r, rs, rc):
    u = (min(max(r, rs), rc) - rs) / (rc - rs)
    return u**3 * (-6 * u**2 + 15 * u - 10) + 1


# Cell shapes that small-cell searches must get right: (edge lengths, tilt)
SMALL_CELLS = {
    "triclinic": ((5.5, 6.5, 7.5), 0.3),  # shorter than 2·rcut (4 Å): several images of a neighbour
    "skewed": ((6.0, 5.0, 7.0), 0.9),  # strongly tilted: planes much closer than the edges
    "tiny": ((1.9, 2.6, 3.3), 0.4),  # shorter than rcut everywhere: own images, many shells
    "slab": ((2.2, 9.0, 10.0), 0.2),  # tiny in one direction only
}


def small_cell_frames(rng, case: str, nframes: int, natoms: int):
    """(coords, boxes) of one `SMALL_CELLS` shape, each frame its own strained cell, atoms
    partly outside it."""
    lengths, tilt = SMALL_CELLS[case]
    boxes = np.stack([random_cell(rng, lengths, tilt) for _ in range(nframes)])
    frac = rng.uniform(-0.4, 1.4, size=(nframes, natoms, 3))  # unwrapped coordinates
    return np.einsum("fai,fij->faj", frac, boxes), boxes
