"""How a model's neighbour lists are laid out, chosen once per model: per-type blocks
(``build_nlist``, the se_e2 family) or one type-mixed list (``build_mixed_nlist``, the
type-embedding descriptors, DeePMD's ``mixed_types``).

Every place that lists neighbours for a model (batches and their cache, statistics, ``test``,
the calculator, model deviation) takes one of the two objects below from `list_layout`, so
the choice is made where the model or its config is known, never inside the maths. Both
build with the same signature and give ``counts`` of shape (natoms, len(sel)): neighbours of
each block found before truncation (one block, all types, for a mixed list whose ``sel`` is
``[total]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mdtrain.neighbors.mixed_nlist import build_mixed_nlist
from mdtrain.neighbors.nlist import build_nlist


@dataclass(frozen=True)
class PerTypeLists:
    """Blocks ``[type 0 sel[0] slots | type 1 ...]``, nearest first in a block."""

    name: str = "per_type"

    def build(self, coord, box, atype, rcut: float, sel: list[int]):
        """``(nlist, shift, counts (natoms, ntypes))`` of one frame (``build_nlist``)."""
        return build_nlist(coord, box, atype, rcut, sel)

    def blocks(self, atype: np.ndarray) -> np.ndarray:
        """The block of the list each atom lands in as a neighbour: its type."""
        return np.asarray(atype, dtype=np.int64)


@dataclass(frozen=True)
class MixedLists:
    """One list of ``sum(sel)`` slots over all types, nearest first (``sel`` is ``[total]``)."""

    name: str = "mixed"

    def build(self, coord, box, atype, rcut: float, sel: list[int]):
        """``(nlist, shift, counts (natoms, 1))`` of one frame (``build_mixed_nlist``)."""
        nlist, shift, counts = build_mixed_nlist(coord, box, rcut, int(sum(sel)))
        return nlist, shift, counts[:, None]

    def blocks(self, atype: np.ndarray) -> np.ndarray:
        """One block for every neighbour, whatever its type."""
        return np.zeros(len(atype), dtype=np.int64)


PER_TYPE = PerTypeLists()
MIXED = MixedLists()
ListLayout = PerTypeLists | MixedLists


def list_layout(mixed_types: bool) -> ListLayout:
    """The layout of a model whose descriptor has (or lacks) DeePMD's ``mixed_types``."""
    return MIXED if mixed_types else PER_TYPE


def layout_of(model) -> ListLayout:
    """The layout of a model (``EnergyModel``, an accelerated one or its TorchScript form:
    the ``mixed_types`` attribute; a frozen file of an mdtrain without it is per type)."""
    return list_layout(bool(getattr(model, "mixed_types", False)))
