"""Environment statistics of the type-mixed descriptors (se_atten, se_atten_v2), as
DeePMD-kit computes them.

Per centre type ``t``, over every slot of its type-mixed list (``sel`` slots: padded ones
count as zeros, excluded pairs too): the radial entries ``s`` form group ``r_t`` and the
three angular entries group ``a_t``. ``davg[t, :, 0]`` is r's mean (0 with
``set_davg_zero``), ``dstd[t, :, 0]`` r's population std and ``dstd[t, :, 1:]`` a's, both
floored at 1e-2 (0.1 for a type never seen): the same groups and rules as se_e2_a's, on
another list, so the descriptor's ``stats_from_items`` (``base.Descriptor``) turns the groups
summed here into the buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from mdtrain.model.descriptors.base import StatItem
from mdtrain.neighbors.mixed_nlist import build_mixed_nlist


def mixed_env_stat_sums(desc, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
    """(ntypes, 2, 3) float64: per centre type, [number, sum, squared sum] of the radial (0)
    and angular (1) raw entries of the lists ``nlist`` (nf, N, sel) with vectors ``diff``.

    Tensor maths only (no value read), so it runs on the model's device, ``meta`` included.
    """
    raw = desc.env_matrix(diff.to(torch.float64), nlist >= 0)
    if desc.has_exclusions:
        raw = raw * desc.keep_mask(nlist, atype).unsqueeze(-1).to(raw.dtype)
    r, a = raw[..., 0], raw[..., 1:]
    per_atom = torch.stack(
        [
            r.sum(dim=(0, 2)),
            r.square().sum(dim=(0, 2)),
            a.sum(dim=(0, 2, 3)),
            a.square().sum(dim=(0, 2, 3)),
        ],
        dim=1,
    )  # (N, 4)
    sums = per_atom.new_zeros(desc.ntypes, 4).index_add_(0, atype, per_atom)
    atoms = torch.bincount(atype, minlength=desc.ntypes).to(per_atom.dtype)
    slots = atoms * float(nlist.shape[0] * nlist.shape[2])
    radial = torch.stack([slots, sums[:, 0], sums[:, 1]], dim=1)
    angular = torch.stack([3.0 * slots, sums[:, 2], sums[:, 3]], dim=1)
    return torch.stack([radial, angular], dim=1)


def mixed_env_stat_items(
    desc, frames: Iterable[tuple[np.ndarray, np.ndarray | None, np.ndarray]]
) -> dict[str, StatItem]:
    """The ``r_t``/``a_t`` groups summed over frames ``(coord (N, 3), box (3, 3) | None,
    atype (N,))``, each listed with `build_mixed_nlist` at the descriptor's rcut and sel."""
    total = torch.zeros(desc.ntypes, 2, 3, dtype=torch.float64)
    for coord, box, atype in frames:
        nlist, shift, _ = build_mixed_nlist(coord, box, desc.rcut, desc.nnei)
        coord = np.asarray(coord, dtype=np.float64)
        neighbour = coord[np.clip(nlist, 0, None)]
        if box is not None:
            neighbour = neighbour + shift @ np.asarray(box, dtype=np.float64)
        diff = torch.as_tensor(neighbour - coord[:, None, :]).unsqueeze(0)
        types = torch.as_tensor(np.asarray(atype, dtype=np.int64))
        total += mixed_env_stat_sums(desc, diff, torch.as_tensor(nlist).unsqueeze(0), types)
    values = total.tolist()
    return {
        f"{group}_{t}": StatItem(*values[t][g])
        for t in range(desc.ntypes)
        for g, group in enumerate(("r", "a"))
    }
