"""DeePMD-kit's numpy evaluation of a combined model's ``.dp`` file, part by part (run with
DeePMD-kit's own Python; it imports neither mdtrain nor torch).

DeePMD-kit 3.2 refuses to build its linear and DP+ZBL models around a descriptor of
per-type neighbour lists (se_e2_a), so ``dp convert-backend`` cannot read such a file. This
script reads it with DeePMD-kit's own reader, builds each part with DeePMD-kit's classes
(``DPAtomicModel``, ``PairTabAtomicModel``), and combines them with DeePMD-kit's own weights
(``DPZBLLinearEnergyAtomicModel._compute_weight`` for ``zbl``; the constant ``weights`` for
``linear``) and the file's ``out_bias``. Neighbours: all periodic images within each part's
cut-off, the nearest ``sel`` (summed) of any type, split by type for a per-type part.

    python deepmd_combined_eval.py model.dp frames.npz out.npz

``frames.npz``: ``coord`` (nf, N, 3), ``box`` (nf, 3, 3), ``atype`` (N,); ``out.npz``:
``atom_energy`` (nf, N).
"""

from __future__ import annotations

import itertools
import sys
import types

import numpy as np
from deepmd.dpmodel.atomic_model.dp_atomic_model import DPAtomicModel
from deepmd.dpmodel.atomic_model.linear_atomic_model import DPZBLLinearEnergyAtomicModel
from deepmd.dpmodel.atomic_model.pairtab_atomic_model import PairTabAtomicModel
from deepmd.dpmodel.utils.nlist import nlist_distinguish_types
from deepmd.dpmodel.utils.serialization import load_dp_model


def part_of(data: dict):
    if data["type"] == "pairtab":
        return PairTabAtomicModel.deserialize(data)
    return DPAtomicModel.deserialize(data)


def mixed_list(coord, box, atype, rcut, nsel):
    ext, ext_t = [coord], [atype]
    for s in itertools.product(range(-2, 3), repeat=3):
        if s != (0, 0, 0):
            ext.append(coord + np.array(s) @ box)
            ext_t.append(atype)
    ext_c, ext_a = np.concatenate(ext), np.concatenate(ext_t)
    dist = np.linalg.norm(ext_c[None] - coord[:, None], axis=-1)
    nlist = -np.ones((len(coord), nsel), dtype=np.int64)
    for i, row in enumerate(dist):
        near = [j for j in np.argsort(row, kind="stable") if 0 < row[j] < rcut][:nsel]
        nlist[i, : len(near)] = near
    return ext_c, ext_a, nlist[None]


def main(model_path: str, frames_path: str, out_path: str) -> None:
    model = load_dp_model(model_path)["model"]
    parts = [part_of(d) for d in model["models"]]
    frames = np.load(frames_path)
    bias = np.asarray(model["@variables"]["out_bias"]).reshape(-1)
    atype = frames["atype"]
    result = []
    for coord, box in zip(frames["coord"], frames["box"]):
        energies, lists = [], []
        for part in parts:
            nsel = part.get_nsel()
            ext_c, ext_a, nlist = mixed_list(coord, box, atype, part.get_rcut(), nsel)
            if not part.mixed_types():
                nlist = nlist_distinguish_types(nlist, ext_a[None], part.get_sel())
            lists.append(nlist)
            out = part.forward_common_atomic(ext_c.reshape(1, -1), ext_a[None], nlist)
            energies.append(out["energy"][0, :, 0])
        if model["type"] == "zbl":
            switch = types.SimpleNamespace(
                sw_rmin=model["sw_rmin"], sw_rmax=model["sw_rmax"], smin_alpha=model["smin_alpha"]
            )
            w = DPZBLLinearEnergyAtomicModel._compute_weight(
                switch, ext_c[None], ext_a[None], lists
            )
            weights = [x[0, :, 0] for x in w]
        else:
            given = model["weights"]
            k = len(parts)
            weights = [1.0] * k if given == "sum" else [1.0 / k] * k if given == "mean" else given
        result.append(sum(w * e for w, e in zip(weights, energies)) + bias[atype])
    np.savez(out_path, atom_energy=np.array(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
