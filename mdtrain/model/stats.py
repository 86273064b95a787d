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
from mdtrain.model.stat_file import (
    DATA_ATTR,
    data_summary,
    descriptor_stat_hash,
    read_stat_file_and_attrs,
    write_stat_file,
)
from mdtrain.neighbors.nlist import build_nlist

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
    plan = stat_batch_plan(systems, nbatch, batch_size)
    if share is not None and share.world > 1:
        natoms = [int(systems[index].natoms) for index, _, _ in plan]
        groups = [(1, (stop - start) * n) for (_, start, stop), n in zip(plan, natoms)]
        mine = share_ranges(groups, share.rank, share.world)
        plan = [item for item, taken in zip(plan, mine, strict=True) if len(taken)]
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


def _bias_inputs(batches: Iterable[dict[str, Any]], ntypes: int) -> tuple[np.ndarray, np.ndarray]:
    rows, energies = [], []
    for batch in batches:
        if "energy" not in batch:
            continue
        nf = len(batch["energy"])
        rows.append(np.tile(np.asarray(batch["natoms_per_type"])[:ntypes], (nf, 1)))
        energies.append(np.asarray(batch["energy"], dtype=np.float64))
    if not rows:
        return np.zeros((0, ntypes)), np.zeros(0)
    return np.concatenate(rows).astype(np.float64), np.concatenate(energies)


def compute_or_load_stats(
    model,
    systems: Sequence[Any],
    stat_file: str | None,
    nbatch: int,
    batch_size: int | None = None,
    share: StatShare = ALONE,
) -> None:
    """Set the model's davg/dstd and energy bias, from the stat file where possible.

    Missing entries are computed from ``collect_stat_batches`` (first ``nbatch`` batches of
    every system) and, when ``stat_file`` is given, written back to it. With a ``share`` of
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
    cached_batches: list[dict[str, Any]] | None = None

    def batches() -> list[dict[str, Any]]:
        nonlocal cached_batches
        if cached_batches is None:
            cached_batches = collect_stat_batches(
                systems, model.get_model_config(), nbatch, batch_size, share
            )
        return cached_batches

    names = [f"{k}_{t}" for t in range(ntypes) for k in ("r", "a")]
    if all(f"{dkey}/{n}" in stored for n in names):
        items = {n: StatItem.from_array(stored[f"{dkey}/{n}"]) for n in names}
        log.info("descriptor statistics loaded from %s", stat_file)
    else:
        mine = descriptor_stat_items(batches(), model, show_progress=report)
        sums = share.total(np.stack([mine[n].to_array() for n in names]))
        items = {n: StatItem.from_array(row) for n, row in zip(names, sums, strict=True)}
        new.update({f"{dkey}/{n}": item.to_array() for n, item in items.items()})
    davg, dstd = davg_dstd_from_items(items, ntypes, desc.nnei, desc.set_davg_zero)
    desc.set_stats(torch.from_numpy(davg), torch.from_numpy(dstd))

    bkey, skey = f"{root}/bias_atom_energy", f"{root}/std_atom_energy"
    if bkey in stored and skey in stored:
        bias, std = stored[bkey].ravel(), stored[skey].ravel()
        log.info("energy bias loaded from %s", stat_file)
    else:
        counts, energies = _bias_inputs(batches(), ntypes)
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
