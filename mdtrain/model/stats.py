"""Model statistics: descriptor davg/dstd, the per-type energy bias, and their HDF5 cache.

Descriptor statistics (DeePMD-compatible): for each centre type t, over all its atoms and all
``sum(sel)`` slots *including padding zeros*, the raw radial column accumulates ``r_t`` and
the three angular columns, pooled, accumulate ``a_t``, each as [number, sum, squared_sum]
summed over systems. ``davg[t,:,0] = mean(r_t)`` (angular means are 0), ``dstd`` is the
population std (angular std centred on the pooled mean), floored at 1e-2, 0.1 when no data.

The sums are computed on the model's device (``stat_inputs`` puts the frames there,
``descriptor_stat_sums`` is tensor maths only, so it also runs on ``meta`` in the tests); only
the per-chunk sums come back. The energy bias is the least-squares solution of
``N_types · bias = E`` over the sampled frames; its residual std is stored for every type.

Ranks may split the work (``StatShare``, ``training.distributed.stat_mode: "shard"``): each
takes a contiguous share of the batches, the descriptor sums are added up, and the energy
bias is solved from the stacked QR factors of every rank's rows (``energy_bias_factor``).
One process runs the same code with a share of one, so both give the same numbers up to the
order of float64 additions.

The numbers are cached in ``training.stat_file`` (layout in ``stat_file.py``). The data
themselves are not hashed (as in DeePMD): delete the file after changing the systems.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mdtrain.data.share import share_ranges
from mdtrain.model.config import normalize_model_config
from mdtrain.model.descriptor import smooth_weight
from mdtrain.model.stat_file import (
    DATA_ATTR,
    data_summary,
    descriptor_stat_hash,
    read_stat_file_and_attrs,
    write_stat_file,
)
from mdtrain.neighbors.nlist import NeighborSearch, build_nlist

log = logging.getLogger("mdtrain.model.stats")

STD_PROTECTION = 1e-2
STD_DEFAULT = 0.1


@dataclass
class StatItem:
    """Running count, sum and sum of squares of one group of environment-matrix entries."""

    number: float = 0.0
    sum: float = 0.0
    squared_sum: float = 0.0

    def __add__(self, other: StatItem) -> StatItem:
        return StatItem(
            self.number + other.number,
            self.sum + other.sum,
            self.squared_sum + other.squared_sum,
        )

    def avg(self, default: float = 0.0) -> float:
        return default if self.number == 0 else self.sum / self.number

    def std(self, default: float = STD_DEFAULT, protection: float = STD_PROTECTION) -> float:
        if self.number == 0:
            return default
        mean = self.sum / self.number
        val = math.sqrt(max(self.squared_sum / self.number - mean * mean, 0.0))
        return protection if val < protection else val

    def to_array(self) -> np.ndarray:
        return np.array([self.number, self.sum, self.squared_sum], dtype=np.float64)

    @classmethod
    def from_array(cls, arr: np.ndarray) -> StatItem:
        number, total, squared = (float(v) for v in np.asarray(arr, dtype=np.float64).ravel())
        return cls(number, total, squared)


def _same(array: np.ndarray) -> np.ndarray:
    return array


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@dataclass(frozen=True)
class StatShare:
    """This process's part of statistics that ``world`` ranks compute together.

    Rank ``rank`` takes a contiguous share of the statistics batches (``share_ranges``);
    ``total`` sums a float64 array over the ranks (an all-reduce), and ``on_main`` runs a
    function on rank 0 and hands its result, or its failure, to every rank (the stat file is
    read and written there). The default is one process doing everything, the same code
    path: the numbers differ between world sizes only by rounding (the order of float64
    additions, the QR factors of the energy bias combined), about 1e-15 relative.
    """

    rank: int = 0
    world: int = 1
    total: Callable[[np.ndarray], np.ndarray] = _same
    on_main: Callable[..., Any] = _call


ALONE = StatShare()


# --------------------------------------------------------------------------------------------
# Sampling


def auto_batch_size(natoms: int) -> int:
    """Frames per statistics batch: DeePMD's "auto" rule, ceil(32 / natoms)."""
    return max(1, math.ceil(32 / natoms))


def stat_batch_plan(
    systems: Sequence[Any], nbatch: int, batch_size: int | None = None
) -> list[tuple[int, int, int]]:
    """``(system index, first frame, stop)`` of every statistics batch, in order: the first
    ``min(nbatch, nbatches)`` batches of ``batch_size`` consecutive frames of every system
    (default ``ceil(32/natoms)``, DeePMD's "auto" batch size)."""
    plan = []
    for index, system in enumerate(systems):
        bs = batch_size or auto_batch_size(system.natoms)
        nframes = min(nbatch * bs, int(system.nframes))
        plan += [(index, a, min(a + bs, nframes)) for a in range(0, nframes, bs)]
    return plan


def my_stat_plan(
    systems: Sequence[Any],
    nbatch: int,
    batch_size: int | None = None,
    share: StatShare | None = None,
) -> list[tuple[int, int, int]]:
    """``stat_batch_plan``, or this rank's contiguous share of it when ``share`` splits the
    work (balanced by atoms)."""
    plan = stat_batch_plan(systems, nbatch, batch_size)
    if share is not None and share.world > 1:
        natoms = [int(systems[index].natoms) for index, _, _ in plan]
        groups = [(1, (stop - start) * n) for (_, start, stop), n in zip(plan, natoms)]
        mine = share_ranges(groups, share.rank, share.world)
        plan = [item for item, taken in zip(plan, mine, strict=True) if len(taken)]
    return plan


def stat_frames(systems: Sequence[Any], plan: list[tuple[int, int, int]], positions=True):
    """``(system, first frame, frames)`` for every system of ``plan``: the frames its
    batches use (consecutive), read once per system: energies, and the positions and
    cells when ``positions``."""
    for index, items in itertools.groupby(plan, key=lambda item: item[0]):
        system = systems[index]
        spans = [(start, stop) for _, start, stop in items]
        first, rows = spans[0][0], np.arange(spans[0][0], spans[-1][1])
        yield system, first, system.frames(rows, labels=("energy",), positions=positions)


def collect_stat_batches(
    systems: Sequence[Any],
    model_config: dict,
    nbatch: int,
    batch_size: int | None = None,
    share: StatShare | None = None,
) -> list[dict[str, Any]]:
    """The batches of ``stat_batch_plan`` with their neighbour lists (this rank's share of
    them when ``share`` splits the work; all of them by default).

    Sampling is deterministic. Each batch is a dict of numpy arrays: ``coord`` (nf,N,3),
    ``box`` (nf,3,3) or None, ``atype`` (N,), ``nlist``, ``shift``, ``natoms_per_type``
    (ntypes,), ``energy`` (nf,) when the system has energies, ``system``.
    """
    cfg = normalize_model_config(model_config)
    desc = cfg["descriptor"]
    rcut, sel, ntypes = float(desc["rcut"]), list(desc["sel"]), len(cfg["type_map"])
    plan = my_stat_plan(systems, nbatch, batch_size, share)
    batches = []
    for index, items in itertools.groupby(plan, key=lambda item: item[0]):
        system = systems[index]
        spans = [(start, stop) for _, start, stop in items]
        first = spans[0][0]
        data = system.frames(np.arange(first, spans[-1][1]))  # one read per system
        atype = np.asarray(system.atype, dtype=np.int64)
        has_energy = "energy" in data and (not hasattr(system, "has") or system.has("energy"))
        for begin, end in spans:
            start, stop = begin - first, end - first
            coord = np.asarray(data["coord"][start:stop], dtype=np.float64)
            box = data.get("box")
            box = None if box is None else np.asarray(box[start:stop], dtype=np.float64)
            lists = [
                build_nlist(coord[f], None if box is None else box[f], atype, rcut, sel)
                for f in range(stop - start)
            ]
            batch = {
                "system": str(getattr(system, "path", "")),
                "coord": coord,
                "box": box,
                "atype": atype,
                "nlist": np.stack([nl for nl, _, _ in lists]),
                "shift": np.stack([sh for _, sh, _ in lists]),
                "natoms_per_type": np.bincount(atype, minlength=ntypes)[:ntypes],
            }
            if has_energy:
                batch["energy"] = np.asarray(data["energy"][start:stop], dtype=np.float64)
            batches.append(batch)
    return batches


# --------------------------------------------------------------------------------------------
# Descriptor statistics


def model_device(model) -> torch.device:
    """Where the model's buffers live: statistics compute there, next to ``pair_keep``."""
    return model.descriptor.davg.device


def stat_inputs(
    batch: dict[str, Any], start: int, stop: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Frames ``start:stop`` of a statistics batch as model inputs on ``device``: coord, box
    (or None), atype, nlist, shift."""

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype, device=device)

    box = batch.get("box")
    return (
        tensor(batch["coord"][start:stop], torch.float64),
        None if box is None else tensor(box[start:stop], torch.float64),
        tensor(batch["atype"], torch.long),
        tensor(batch["nlist"][start:stop], torch.long),
        tensor(batch["shift"][start:stop], torch.long),
    )


def descriptor_stat_sums(
    model,
    coord: torch.Tensor,
    box: torch.Tensor | None,
    atype: torch.Tensor,
    nlist: torch.Tensor,
    shift: torch.Tensor,
) -> torch.Tensor:
    """(ntypes, 2, 3) float64 on the inputs' device: per centre type, the radial (0) and the
    pooled angular (1) entries of the raw environment matrix (exclusions zeroed) as [number,
    sum, squared sum].

    Tensor maths only (no value read, no boolean mask), so that it runs on any device, the
    ``meta`` device included, where a tensor on another device than the model's fails.
    """
    desc = model.descriptor
    diff = model.pair_vectors(coord, box, nlist, shift)
    raw = desc.env_matrix(diff, nlist >= 0)
    raw = raw * desc.keep_mask(nlist, atype).unsqueeze(-1).to(raw.dtype)
    r, a = raw[..., 0], raw[..., 1:]
    per_atom = torch.stack(
        [
            r.sum(dim=(0, 2)),
            (r * r).sum(dim=(0, 2)),
            a.sum(dim=(0, 2, 3)),
            (a * a).sum(dim=(0, 2, 3)),
        ],
        dim=1,
    )  # (N, 4)
    ones = torch.ones_like(per_atom[:, 0])
    sums = per_atom.new_zeros(desc.ntypes, 4).index_add_(0, atype, per_atom)
    centres = per_atom.new_zeros(desc.ntypes).index_add_(0, atype, ones)
    number = centres * float(raw.shape[0] * raw.shape[2])  # frames · slots per centre
    radial = torch.stack([number, sums[:, 0], sums[:, 1]], dim=1)
    angular = torch.stack([3.0 * number, sums[:, 2], sums[:, 3]], dim=1)
    return torch.stack([radial, angular], dim=1)


def descriptor_stat_items(
    batches: Iterable[dict[str, Any]], model, show_progress: bool = True
) -> dict[str, StatItem]:
    """Accumulate ``r_t``/``a_t`` items over batches (raw env mat, exclusions zeroed), on the
    model's device; one transfer of the sums per chunk.

    Frames are evaluated in chunks that adapt to the memory available (the sums do not depend
    on the chunking), so statistics of very large frames back off instead of failing.
    """
    from mdtrain.memory import InferenceChunker
    from mdtrain.progress import progress

    desc = model.descriptor
    device = model_device(model)
    items = {f"{k}_{t}": StatItem() for t in range(desc.ntypes) for k in ("r", "a")}
    chunker = InferenceChunker(device=device)
    batches = list(batches)

    def chunk_items(batch: dict[str, Any], start: int, stop: int) -> dict[str, StatItem]:
        sums = descriptor_stat_sums(model, *stat_inputs(batch, start, stop, device))
        values = sums.cpu().tolist()
        return {
            f"{k}_{t}": StatItem(*values[t][j])
            for t in range(desc.ntypes)
            for j, k in enumerate(("r", "a"))
        }

    with torch.no_grad():
        for batch in progress(batches, len(batches), "data statistics", show_progress):
            nframes, natoms = batch["coord"].shape[0], batch["coord"].shape[1]
            parts = chunker.run_all(
                lambda a, b, batch=batch: chunk_items(batch, a, b),
                nframes, natoms, batch.get("system", ""),
            )  # fmt: skip
            for part in parts:
                for key, item in part.items():
                    items[key] += item
    return items


def frame_pairs(
    search: NeighborSearch,
    coord: np.ndarray,
    box: np.ndarray | None,
    atype: np.ndarray,
    sel: list[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """The entries of one frame's neighbour list as pairs: centre and neighbour indices
    (P,), neighbour-minus-centre vectors (P, 3), and whether each pair stands for both
    directions (centre j with the opposite vector too).

    The entries are those ``build_nlist`` keeps at the search's cutoff: every pair within
    it, given once for both directions, or, where a centre has more neighbours of a type
    than ``sel`` holds (then it is asked), the nearest ones, one entry per direction.
    Vectors are formed as ``pair_vectors`` forms them: (neighbour - centre) + shift · cell.
    """
    ntypes, natoms = len(sel), len(atype)
    i, j, shift, _ = search.compute(coord, box, full=False, shifts=True, copy=False)
    ends = np.concatenate((i * ntypes + atype[j], j * ntypes + atype[i]))
    counts = np.bincount(ends, minlength=natoms * ntypes).reshape(natoms, ntypes)
    both = bool((counts <= np.asarray(sel)).all())
    if not both:
        nlist, shift_all, _ = build_nlist(coord, box, atype, search.rcut, sel)
        i, slot = np.nonzero(nlist >= 0)
        j, shift = nlist[i, slot], shift_all[i, slot]
    diff = coord[j] - coord[i]
    if box is not None:
        diff += shift @ box  # int64 shifts: matmul converts them to float64
    return i, j, diff, both


class PairStatSums:
    """Descriptor statistics accumulated from neighbour pairs, frame by frame.

    Equal to ``descriptor_stat_sums`` over the padded lists of the same frames (up to the
    order of float64 additions): a padded slot adds 0 to the sums and 1 to the count, so
    the sums need the real pairs only and the counts are ``centres · frames · sum(sel)``;
    a pair seen from its other end has the same radial entry and opposite angular ones, so
    each pair is evaluated once. Pairs are evaluated with the descriptor's switch and
    formula (``_chunk``) in chunks of up to ``chunk_pairs`` on ``device``, whatever the
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
        ntypes = self.desc.ntypes
        self.centres = np.zeros(ntypes)  # centre atoms of each type, over the frames added
        self.sums = torch.zeros(ntypes, 4, dtype=torch.float64, device=self.device)
        self.chunk_pairs = int(chunk_pairs)
        self.chunker = InferenceChunker(self.chunk_pairs, self.chunk_pairs, self.device)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._npending = 0

    @classmethod
    def of_model(cls, model, chunk_pairs: int | None = None) -> PairStatSums:
        return cls(model.descriptor, model_device(model), chunk_pairs)

    def add_frame(self, coord: np.ndarray, box: np.ndarray | None, atype: np.ndarray) -> None:
        """One frame: coordinates (N, 3), cell or None, model types (N,); searched here."""
        i, j, diff, both = frame_pairs(self.search, coord, box, atype, self.desc.sel)
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
        """Per centre type [Σ s, Σ s², Σ (a_x + a_y + a_z), Σ |a|²] of the raw rows
        ``[s, a] = w(r)/(r+p) · [1, d/(r+p)]`` (``env_matrix``'s formula, ``p`` its
        ``env_protection``) of pairs ``diff`` (neighbour minus centre), ``key`` =
        (centre type · ntypes + neighbour type) · 2 + mirror: each pair counts for its centre
        and, where ``mirror``, for the neighbour too (``-d``: the same s and |a|², the
        opposite angular sum). The components' sums are taken per pair first, then summed
        per key in one pass, then per type (a tiny table): few passes over the pairs."""
        desc, device = self.desc, self.device
        ntypes = desc.ntypes
        index = torch.as_tensor(key, device=device)
        d = torch.as_tensor(diff, dtype=torch.float64, device=device)
        ones = torch.ones(3, dtype=d.dtype, device=device)
        r2 = (d * d) @ ones
        r = torch.sqrt(r2)
        rp = r + desc.env_protection
        s = smooth_weight(r, desc.rcut_smth, desc.rcut) / rp
        q = s / rp  # a = d · q
        per_pair = (s, s * s, (d @ ones) * q, r2 * (q * q))
        keys = 2 * ntypes * ntypes
        table = torch.stack(
            [torch.bincount(index, weights=w, minlength=keys) for w in per_pair], dim=1
        ).view(ntypes, ntypes, 2, 4)
        if desc.has_exclusions:
            table *= desc.pair_keep[:ntypes, :ntypes, None, None].to(table.dtype)
        seen_back = table[:, :, 1].sum(dim=0)  # mirrored pairs by neighbour type
        seen_back[:, 2].neg_()
        return table.sum(dim=(1, 2)) + seen_back

    def items(self, nnei: int | None = None) -> dict[str, StatItem]:
        """The ``r_t``/``a_t`` items, as `descriptor_stat_items` returns them, for lists of
        ``nnei`` slots (default: the descriptor's)."""
        self.flush()
        sums = self.sums.cpu().tolist()
        slots = float(self.desc.nnei if nnei is None else nnei)
        items = {}
        for t in range(self.desc.ntypes):
            number = float(self.centres[t]) * slots
            items[f"r_{t}"] = StatItem(number, sums[t][0], sums[t][1])
            items[f"a_{t}"] = StatItem(3.0 * number, sums[t][2], sums[t][3])
        return items


class StatCollector:
    """Descriptor statistics gathered while the neighbour statistics search the frames, so
    that the frames the data statistics sample are searched once, not twice (on thousands of
    small systems the search is most of the time to the first step).

    Built from the model config before ``sel`` is known: the sums depend only on the
    cut-offs, ``env_protection`` and the exclusions (a stand-in descriptor with those
    evaluates them). ``visit`` is the neighbour statistics' per-frame hook (systems indexed
    as in that pass; the first ``len(systems)`` are the training systems). `items_for` hands
    the items to a model whose lists hold every neighbour seen, else None (then they are
    computed the usual way, e.g. when an explicit ``sel`` truncates the lists).
    """

    def __init__(self, systems: Sequence[Any], model_config: dict, nbatch: int, device) -> None:
        from mdtrain.model.descriptor import DescriptorSeA

        ntypes = len(model_config["type_map"])
        config = copy.deepcopy(model_config)
        config["descriptor"]["sel"] = [1] * ntypes  # not known yet; the sums do not need it
        desc = normalize_model_config(config)["descriptor"]
        self.ntypes = ntypes
        self.key = _env_key(desc)
        stand_in = DescriptorSeA(
            self.ntypes, [1] * self.ntypes, desc["rcut"], desc["rcut_smth"], [1], 1,
            exclude_types=desc.get("exclude_types"), env_protection=desc["env_protection"],
        ).to(device)  # fmt: skip
        self.sums = PairStatSums(stand_in, torch.device(device))
        self.plan = stat_batch_plan(systems, nbatch)
        self.limit = [0] * len(systems)  # the sampled frames of system k are 0 .. limit[k]
        for index, _, stop in self.plan:
            self.limit[index] = max(self.limit[index], stop)
        self.atypes = [np.asarray(s.atype, dtype=np.int64) for s in systems]
        self.max_counts: list[int] | None = None  # the search's, once it has finished
        self.seen = 0

    def visit(self, index: int, frame: int, i, j, vec) -> None:
        """One searched frame: half-list pairs ``i``, ``j`` and their vectors (kept as given)."""
        if index >= len(self.limit) or frame >= self.limit[index]:
            return
        self.sums.add_pairs(self.atypes[index], i, j, vec, True)
        self.seen += 1

    def searched(self, max_counts: list[int]) -> None:
        """The largest neighbour counts the search found (over these frames and more)."""
        self.max_counts = [int(n) for n in max_counts]

    def items_for(self, model, plan: list[tuple[int, int, int]]) -> dict[str, StatItem] | None:
        desc = model.descriptor
        complete = self.seen == sum(self.limit) and plan == self.plan
        counts = self.max_counts
        fits = counts is not None and all(n <= s for n, s in zip(counts, desc.sel, strict=True))
        same = self.key == _env_key(normalize_model_config(model.get_model_config())["descriptor"])
        return self.sums.items(desc.nnei) if complete and fits and same else None


def _env_key(desc: dict) -> tuple:
    """What the descriptor statistics depend on besides the frames."""
    exclusions = sorted(tuple(sorted(p)) for p in desc.get("exclude_types") or [])
    return (float(desc["rcut"]), float(desc["rcut_smth"]), float(desc["env_protection"]),
            tuple(exclusions))  # fmt: skip


def stream_stat_inputs(
    systems: Sequence[Any],
    model,
    plan: list[tuple[int, int, int]],
    descriptor: bool = True,
    show_progress: bool = True,
) -> tuple[dict[str, StatItem] | None, np.ndarray, np.ndarray]:
    """One pass over the frames of ``plan``: the descriptor items (when ``descriptor``) and
    the energy bias's inputs (atoms per type and energy of every frame with an energy).

    Nothing proportional to the number of systems is kept but those two small arrays: each
    system's frames are read, turned into pairs and added up, then dropped.
    """
    from mdtrain.progress import progress

    ntypes = model.descriptor.ntypes
    sums = PairStatSums.of_model(model) if descriptor else None
    rows: list[np.ndarray] = []
    energies: list[np.ndarray] = []
    nsystems = len({index for index, _, _ in plan})
    for system, _, data in progress(
        stat_frames(systems, plan, positions=sums is not None),
        nsystems, "data statistics", show_progress,
    ):  # fmt: skip
        atype = np.asarray(system.atype, dtype=np.int64)
        per_type = np.bincount(atype, minlength=ntypes)[:ntypes]
        nf = len(next(iter(data.values()))) if data else 0
        if sums is not None:
            coord = np.asarray(data["coord"], dtype=np.float64)
            box = data.get("box")
            for f in range(nf):
                sums.add_frame(coord[f], None if box is None else box[f], atype)
        if "energy" in data and (not hasattr(system, "has") or system.has("energy")):
            rows.append(np.tile(per_type, (nf, 1)))
            energies.append(np.asarray(data["energy"], dtype=np.float64))
    counts = np.concatenate(rows).astype(np.float64) if rows else np.zeros((0, ntypes))
    energy = np.concatenate(energies) if energies else np.zeros(0)
    return (None if sums is None else sums.items()), counts, energy


def davg_dstd_from_items(
    items: dict[str, StatItem], ntypes: int, nnei: int, set_davg_zero: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(ntypes, nnei, 4) mean and std arrays, tiled over the slots of each centre type."""
    davg = np.zeros((ntypes, nnei, 4))
    dstd = np.ones((ntypes, nnei, 4))
    for t in range(ntypes):
        r = items.get(f"r_{t}", StatItem())
        a = items.get(f"a_{t}", StatItem())
        if not set_davg_zero:
            davg[t, :, 0] = r.avg()
        dstd[t, :, 0] = r.std()
        dstd[t, :, 1:] = a.std()
    return davg, dstd


def compute_descriptor_stats(
    batches: Iterable[dict[str, Any]], model
) -> tuple[np.ndarray, np.ndarray]:
    """davg and dstd (ntypes, nnei, 4) of the model's descriptor over the given batches."""
    desc = model.descriptor
    items = descriptor_stat_items(batches, model)
    return davg_dstd_from_items(items, desc.ntypes, desc.nnei, desc.set_davg_zero)


# --------------------------------------------------------------------------------------------
# Energy bias


def energy_bias_factor(natoms_per_type: np.ndarray, energies: np.ndarray) -> np.ndarray:
    """(ntypes+1, ntypes+1): the triangular factor R of a QR factorisation of ``[N | E]``,
    zero rows added when there are fewer frames.

    What ranks exchange for the energy bias: the factors of row blocks stacked have the Gram
    matrix of the whole ``[N | E]`` (the sum of theirs), hence its singular values and its
    least-squares solutions, and, unlike the normal equations ``NᵀN``, ``NᵀE``, they keep
    the condition number of ``N`` instead of squaring it (the minimum-norm solution of
    one-composition data, where ``N`` has rank one, stays well defined).
    """
    block = np.hstack([natoms_per_type, energies.reshape(-1, 1)])
    size = block.shape[1]
    factor = np.zeros((size, size))
    if len(block):
        r = np.linalg.qr(block, mode="r")
        factor[: len(r)] = r
    return factor


def compute_energy_bias(
    natoms_per_type: np.ndarray,
    energies: np.ndarray,
    rcond: float | None = None,
    share: StatShare = ALONE,
) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares per-type energy (ntypes,) and the residual std (same value per type).

    DeePMD's definition: ``lstsq(N, E, rcond)`` over all sampled frames (minimum-norm, the
    singular values of ``N`` below ``rcond`` times the largest cut, by default machine
    precision times the number of frames), then ``std(E - N · bias)``. The rows given are
    this rank's; the solve runs on the stacked factors of every rank
    (``energy_bias_factor``), the std from summed residuals, on every rank alike. The frames
    of all ranks together must be at least one.
    """
    n = np.asarray(natoms_per_type, dtype=np.float64)
    e = np.asarray(energies, dtype=np.float64).reshape(-1)
    if n.ndim != 2 or n.shape[0] != e.shape[0]:
        raise ValueError(f"natoms_per_type {n.shape} does not match energies {e.shape}")
    ntypes = n.shape[1]
    size = (ntypes + 1) ** 2
    slots = np.zeros(share.world * size + 1)
    slots[share.rank * size : (share.rank + 1) * size] = energy_bias_factor(n, e).ravel()
    slots[-1] = len(e)
    slots = share.total(slots)
    nrows = int(round(slots[-1]))
    if nrows == 0:
        raise ValueError("no frame to fit the energy bias to")
    stacked = slots[:-1].reshape(share.world * (ntypes + 1), ntypes + 1)
    cut = rcond if rcond is not None else np.finfo(np.float64).eps * max(nrows, ntypes)
    bias = np.linalg.lstsq(stacked[:, :ntypes], stacked[:, ntypes], rcond=cut)[0]
    residual = e - n @ bias
    mean = share.total(np.array([residual.sum()]))[0] / nrows
    squares = share.total(np.array([np.square(residual - mean).sum()]))[0]
    return bias, np.full(ntypes, math.sqrt(squares / nrows))


def compute_or_load_stats(
    model,
    systems: Sequence[Any],
    stat_file: str | None,
    nbatch: int,
    batch_size: int | None = None,
    share: StatShare = ALONE,
    presummed: StatCollector | None = None,
) -> None:
    """Set the model's davg/dstd and energy bias, from the stat file where possible.

    Missing entries are computed in one streamed pass (``stream_stat_inputs``) over the
    first ``nbatch`` batches of every system (``stat_batch_plan``) and, when ``stat_file``
    is given, written back to it; descriptor sums a `StatCollector` gathered during the
    neighbour statistics are used when they fit the model. With a ``share`` of
    several ranks every rank calls this: each computes its share of the batches, the sums
    are combined, and every rank's model gets the same statistics; rank 0 alone reads and
    writes the file.
    """
    desc = model.descriptor
    ntypes = desc.ntypes
    report = share.rank == 0
    root = " ".join(model.type_map)
    dkey = f"{root}/{descriptor_stat_hash(model)}"
    stored, attrs = share.on_main(read_stat_file_and_attrs, stat_file) if stat_file else ({}, {})
    summary = data_summary(systems)
    if stored and attrs.get(DATA_ATTR) not in (None, summary) and report:
        log.warning(
            "%s holds statistics of other training data (other system sizes): they are "
            "used as they are; delete the file to compute them from this data",
            stat_file,
        )
    new: dict[str, np.ndarray] = {}
    names = [f"{k}_{t}" for t in range(ntypes) for k in ("r", "a")]
    bkey, skey = f"{root}/bias_atom_energy", f"{root}/std_atom_energy"
    have_items = all(f"{dkey}/{n}" in stored for n in names)
    have_bias = bkey in stored and skey in stored
    if not (have_items and have_bias):  # one pass over the sampled frames for both
        plan = my_stat_plan(systems, nbatch, batch_size, share)
        gathered = None
        if not have_items and presummed is not None and share.world == 1:
            gathered = presummed.items_for(model, plan)
        mine, counts, energies = stream_stat_inputs(
            systems, model, plan, descriptor=not have_items and gathered is None,
            show_progress=report,
        )  # fmt: skip
        if gathered is not None:
            log.debug("descriptor statistics gathered with the neighbour statistics")
            mine = gathered
    if have_items:
        items = {n: StatItem.from_array(stored[f"{dkey}/{n}"]) for n in names}
        log.info("descriptor statistics loaded from %s", stat_file)
    else:
        sums = share.total(np.stack([mine[n].to_array() for n in names]))
        items = {n: StatItem.from_array(row) for n, row in zip(names, sums, strict=True)}
        new.update({f"{dkey}/{n}": item.to_array() for n, item in items.items()})
    davg, dstd = davg_dstd_from_items(items, ntypes, desc.nnei, desc.set_davg_zero)
    desc.set_stats(torch.from_numpy(davg), torch.from_numpy(dstd))

    if have_bias:
        bias, std = stored[bkey].ravel(), stored[skey].ravel()
        log.info("energy bias loaded from %s", stat_file)
    else:
        if share.total(np.array([float(len(energies))]))[0] == 0:
            if report:
                log.warning("no sampled frame has an energy label: the energy bias stays 0")
            bias, std = np.zeros(ntypes), np.ones(ntypes)
        else:
            keep = model.atom_keep.cpu().numpy()  # atom_exclude_types contribute no energy
            bias, std = compute_energy_bias(
                counts * keep, energies, model.get_model_config()["fitting_net"]["rcond"], share
            )
            new[bkey], new[skey] = bias.reshape(ntypes, 1), std.reshape(ntypes, 1)
    model.set_out_bias(bias, std)
    log.info(
        "energy bias per type: %s",
        ", ".join(f"{t} {b:.6g}" for t, b in zip(model.type_map, bias, strict=True)),
    )
    if stat_file and new:
        share.on_main(write_stat_file, stat_file, new, {DATA_ATTR: summary})
        log.info("statistics written to %s", stat_file)
