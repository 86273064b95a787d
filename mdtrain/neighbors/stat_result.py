"""The result records of the neighbour statistics: what ``stat`` computes, ``stat_file``
writes and reads, and training compares with its data (kept apart from the computation so
that readers of a file need not import it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mdtrain.neighbors.fingerprint import content_hash, data_fingerprint


@dataclass
class SystemNeighborStat:
    """The statistics of one system."""

    path: str
    nframes: int
    natoms: int
    min_nbor_dist: float  # inf when no two atoms are ever found (a single isolated atom)
    max_nbor_size: list[int]
    fingerprint: dict[str, Any] = field(default_factory=dict)
    max_nbor_total: int = 0

    @property
    def sha256(self) -> str:
        return content_hash(self.fingerprint)


@dataclass
class NeighborStat:
    """The statistics of a set of systems: the overall figures and one entry per system."""

    rcut: float
    min_nbor_dist: float
    max_nbor_size: list[int]
    systems: list[SystemNeighborStat]
    max_nbor_total: int = 0

    @property
    def fingerprint(self) -> str:
        return data_fingerprint([s.sha256 for s in self.systems])
