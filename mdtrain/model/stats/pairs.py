"""Environment statistics from neighbour pairs: the sums each descriptor's ``stat_groups``
need, accumulated frame by frame from the cell-list search, without padded lists."""

from __future__ import annotations

import numpy as np
import torch

from mdtrain.model.descriptors.base import StatItem
from mdtrain.neighbors.layout import PER_TYPE, ListLayout, list_layout
from mdtrain.neighbors.nlist import NeighborSearch


def frame_pairs(
    search: NeighborSearch,
    coord: np.ndarray,
    box: np.ndarray | None,
    atype: np.ndarray,
    sel: list[int],
    layout: ListLayout = PER_TYPE,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """The entries of one frame's neighbour list as pairs: centre and neighbour indices
    (P,), neighbour-minus-centre vectors (P, 3), and whether each pair stands for both
    directions (centre j with the opposite vector too).

    The entries are those ``layout.build`` keeps at the search's cutoff: every pair within
    it, given once for both directions, or, where a centre has more neighbours in a block
    of its list (a type; all types for a type-mixed list, ``sel`` = [total]) than ``sel``
    holds (then it is asked), the nearest ones, one entry per direction.
    Vectors are formed as ``pair_vectors`` forms them: (neighbour - centre) + shift · cell.
    """
    nblocks, natoms = len(sel), len(atype)
    i, j, shift, _ = search.compute(coord, box, full=False, shifts=True, copy=False)
    block = layout.blocks(atype)
    ends = np.concatenate((i * nblocks + block[j], j * nblocks + block[i]))
    counts = np.bincount(ends, minlength=natoms * nblocks).reshape(natoms, nblocks)
    both = bool((counts <= np.asarray(sel)).all())
    if not both:
        nlist, shift_all, _ = layout.build(coord, box, atype, search.rcut, sel)
        i, slot = np.nonzero(nlist >= 0)
        j, shift = nlist[i, slot], shift_all[i, slot]
    diff = coord[j] - coord[i]
    if box is not None:
        diff += shift @ box  # int64 shifts: matmul converts them to float64
    return i, j, diff, both


class PairStatSums:
    """Descriptor statistics accumulated from neighbour pairs, frame by frame.

    Equal to the sums over the padded lists (``tests/helpers/padded_stats.py``) of the same frames (up to the
    order of float64 additions): a padded slot adds 0 to the sums and 1 to the count, so
    the sums need the real pairs only and the counts are ``centres · frames · sum(sel)``;
    a pair seen from its other end gives the same terms up to the signs ``stat_mirror``
    says, so each pair is evaluated once. Pairs are evaluated with the descriptor's own
    ``pair_stat_terms`` (``_chunk``) in chunks of up to ``chunk_pairs`` on ``device``, whatever the
    systems: thousands of small
    systems cost a few large evaluations instead of one small evaluation per batch, and
    memory stays bounded (the chunk halves on an out-of-memory error).

    ``desc`` is the model's descriptor, or one with the same cut-offs and exclusions (the
    sums do not depend on ``sel``; the counts take it in ``items``).
    """

    def __init__(self, desc, device: torch.device, chunk_pairs: int | None = None) -> None:
        from mdtrain.memory import InferenceChunker

        self.desc = desc
        self.device = device
        if chunk_pairs is None:  # a CPU evaluates pairs fastest when the chunk stays in cache
            chunk_pairs = 1 << 15 if torch.device(device).type == "cpu" else 1 << 20
        # pairs kept before they are evaluated, chunk after chunk: evaluating each chunk as
        # soon as it fills, between searches, ran at half the speed (cold caches)
        self.pending_pairs = max(int(chunk_pairs), 1 << 18)
        self.search = NeighborSearch(self.desc.rcut)
        self.layout = list_layout(self.desc.mixed_types)
        ntypes = self.desc.ntypes
        self.centres = np.zeros(ntypes)  # centre atoms of each type, over the frames added
        self.sums = torch.zeros(
            ntypes, 2 * len(self.desc.stat_groups), dtype=torch.float64, device=self.device
        )
        self.chunk_pairs = int(chunk_pairs)
        self.chunker = InferenceChunker(self.chunk_pairs, self.chunk_pairs, self.device)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._npending = 0

    @classmethod
    def of_model(cls, model, chunk_pairs: int | None = None) -> PairStatSums:
        return cls(model.descriptor, model.descriptor.davg.device, chunk_pairs)

    def add_frame(self, coord: np.ndarray, box: np.ndarray | None, atype: np.ndarray) -> None:
        """One frame: coordinates (N, 3), cell or None, model types (N,); searched here."""
        i, j, diff, both = frame_pairs(self.search, coord, box, atype, self.desc.sel, self.layout)
        self.add_pairs(atype, i, j, diff, both)

    def add_pairs(self, atype, i, j, diff, both: bool) -> None:
        """One frame's list entries as ``frame_pairs`` gives them."""
        ntypes = self.desc.ntypes
        self.centres += np.bincount(atype, minlength=ntypes)
        key = atype[i] * ntypes + atype[j]
        key *= 2
        key += both  # see ``_chunk``
        self._pending.append((key, diff))
        self._npending += len(i)
        if self._npending >= self.pending_pairs:
            self.flush()

    def add_frames(self, atypes: np.ndarray, key: np.ndarray, diff: np.ndarray, sizes) -> None:
        """Many frames' list entries at once, as `add_pairs` would take them frame after
        frame: the model types of all their atoms (concatenated), each pair's key (see
        ``_chunk``), its vector, and each frame's number of pairs. The pending pairs are
        evaluated after the same frames as `add_pairs` would (the same sums, bit for bit)."""
        self.centres += np.bincount(atypes, minlength=self.desc.ntypes)
        ends = np.cumsum(sizes)
        start, total = 0, int(ends[-1]) if len(ends) else 0
        while start < total:
            # the first frame after which `add_pairs` would hold enough pairs to evaluate
            k = int(np.searchsorted(ends, start + self.pending_pairs - self._npending))
            stop = total if k >= len(ends) else int(ends[k])
            self._pending.append((key[start:stop], diff[start:stop]))
            self._npending += stop - start
            if self._npending >= self.pending_pairs:
                self.flush()
            start = stop

    def flush(self) -> None:
        if not self._npending:
            return
        key, diff = (np.concatenate(p) for p in zip(*self._pending, strict=True))
        self._pending, self._npending = [], 0

        def run(a: int, b: int) -> None:
            self.sums += self._chunk(key[a:b], diff[a:b])

        with torch.no_grad():
            self.chunker.run_all(run, len(key), 1, "data statistics")

    def _chunk(self, key: np.ndarray, diff: np.ndarray) -> torch.Tensor:
        """Per centre type, the descriptor's ``pair_stat_terms`` (for se_e2_a [Σ s, Σ s²,
        Σ (a_x + a_y + a_z), Σ |a|²]) of pairs ``diff`` (neighbour minus centre), ``key`` =
        (centre type · ntypes + neighbour type) · 2 + mirror: each pair counts for its centre
        and, where ``mirror``, for the neighbour too (``-d``: the sums of the groups whose
        ``stat_mirror`` is -1 change sign, the rest stay). The terms are taken per pair
        first, then summed per key in one pass, then per type (a tiny table): few passes
        over the pairs."""
        desc, device = self.desc, self.device
        ntypes = desc.ntypes
        index = torch.as_tensor(key, device=device)
        d = torch.as_tensor(diff, dtype=torch.float64, device=device)
        per_pair = desc.pair_stat_terms(d)
        keys = 2 * ntypes * ntypes
        table = torch.stack(
            [torch.bincount(index, weights=w, minlength=keys) for w in per_pair], dim=1
        ).view(ntypes, ntypes, 2, len(per_pair))
        if desc.has_exclusions:
            table *= desc.stat_pair_keep().to(table.dtype)
        seen_back = table[:, :, 1].sum(dim=0)  # mirrored pairs by neighbour type
        for g, sign in enumerate(desc.stat_mirror):
            if sign < 0:
                seen_back[:, 2 * g].neg_()
        return table.sum(dim=(1, 2)) + seen_back

    def items(self, desc=None) -> dict[str, StatItem]:
        """The items ``<group>_<type>`` of the descriptor's ``stat_groups`` (se_e2_a:
        ``r_t``/``a_t``), those of the padded lists, for the lists of ``desc`` (default:
        the descriptor summed; a stand-in's sums serve the model's descriptor)."""
        self.flush()
        sums = self.sums.cpu().tolist()
        per_centre = (desc or self.desc).stat_slots()
        items = {}
        for t in range(self.desc.ntypes):
            for g, name in enumerate(self.desc.stat_groups):
                count = float(self.centres[t]) * per_centre[g]
                items[f"{name}_{t}"] = StatItem(count, sums[t][2 * g], sums[t][2 * g + 1])
        return items
