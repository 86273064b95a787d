"""The DeePMD-kit descriptor fixture (``tests/fixtures/deepmd/se_atten.npz``, made by
``make_se_atten_fixture.py`` there): its variants, serialised models, frames and answers,
and the descriptor inputs of a frame as mdtrain builds them."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from tests.helpers.serialized_npz import read

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepmd" / "se_atten.npz"
GROUPS = ("periodic", "cluster")


@lru_cache(maxsize=1)
def _arrays() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


def variants() -> list[str]:
    return sorted({k.split("/")[0] for k in _arrays() if k.endswith("/config")})


def config(variant: str) -> dict:
    """The descriptor section as DeePMD-kit's argcheck filled it (with its ``type``)."""
    return json.loads(str(_arrays()[f"{variant}/config"]))


def serialized(variant: str) -> dict:
    """DeePMD-kit's ``serialize()`` dict, arrays restored (dtype as written)."""
    return read(_arrays(), variant)


def frames(group: str) -> dict:
    """``coord`` (nf, N, 3), ``atype`` (N,), ``box`` (nf, 3, 3) or None."""
    data = _arrays()
    box = data.get(f"{group}/box")
    return {"coord": data[f"{group}/coord"], "atype": data[f"{group}/atype"], "box": box}


def expected(variant: str, group: str) -> np.ndarray:
    """DeePMD-kit's descriptor (nf, N, dim_out)."""
    return _arrays()[f"{variant}/{group}/descriptor"]


def mixed_inputs(coord, box, rcut: float, sel: int):
    """``(nlist, shift)`` (nf, N, sel[, 3]) torch tensors of mdtrain's type-mixed lists."""
    from mdtrain.neighbors.mixed_nlist import build_mixed_nlist

    lists = [build_mixed_nlist(c, None if box is None else b, rcut, sel) for c, b in
             zip(coord, box if box is not None else [None] * len(coord))]  # fmt: skip
    nlist = torch.as_tensor(np.stack([nl for nl, _, _ in lists]))
    shift = torch.as_tensor(np.stack([sh for _, sh, _ in lists]))
    return nlist, shift


def pair_diff(coord: torch.Tensor, box, nlist: torch.Tensor, shift: torch.Tensor):
    """Neighbour-minus-centre vectors (nf, N, sel, 3), differentiable in ``coord``/``box``."""
    nf, natoms, nnei = nlist.shape
    idx = nlist.clamp(min=0).reshape(nf, -1, 1).expand(-1, -1, 3)
    neighbour = torch.gather(coord, 1, idx).reshape(nf, natoms, nnei, 3)
    if box is not None:
        neighbour = neighbour + torch.einsum("fnsk,fkc->fnsc", shift.to(coord.dtype), box)
    return neighbour - coord.unsqueeze(2)
