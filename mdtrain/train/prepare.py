"""Everything before the first step: systems, neighbour statistics and sel, the model and its
data statistics. Work that one rank suffices for runs on rank 0 and is broadcast; with
``training.distributed.stat_mode: "shard"`` every rank computes the statistics of its share
of the frames and the ranks combine them (max, min, sums)."""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import time
from dataclasses import dataclass, fields

import numpy as np
import torch

from mdtrain import distributed as dist_rt
from mdtrain.batching import NeighborLimit
from mdtrain.config import mixed_list, mixed_types, resolve_path
from mdtrain.config.model_kind import PAIRTAB, model_type, parts
from mdtrain.data import System, expand_systems, open_all, validate_system
from mdtrain.data.labels import output_labels
from mdtrain.data.share import share_ranges
from mdtrain.data.validate import clean_systems
from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors import descriptor_class
from mdtrain.model.stats import StatCollector, StatShare, compute_or_load_stats
from mdtrain.neighbors.sel import parse_sel, resolve_sel
from mdtrain.neighbors.stat import (
    NeighborPartial,
    compute_neighbor_stat,
    neighbor_stat_partial,
    neighbor_stat_result,
)
from mdtrain.neighbors.stat_file import check_neighbor_stat_matches, load_neighbor_stat
from mdtrain.train.sampler import make_sampler

log = logging.getLogger("mdtrain")


@dataclass
class DataSets:
    train: list[System]
    valid: list[System]


def open_datasets(config: dict, config_path: str) -> DataSets:
    """Expand and open the training and validation systems named by the input (lazy reads)."""
    type_map = config["model"]["type_map"]
    outputs = output_labels(config["model"])

    def systems_of(section: str) -> list[System]:
        data = config["training"].get(section)
        if not data:
            return []
        entries = data["systems"]
        entries = [entries] if isinstance(entries, str) else entries
        try:
            paths = expand_systems([resolve_path(config_path, e) for e in entries], ".")
        except MDTrainError as exc:
            raise MDTrainError(f"{config_path}: training.{section}.systems: {exc}") from None
        if not paths:
            raise MDTrainError(f"{config_path}: training.{section}.systems names no system")
        return open_all(paths, type_map, outputs)

    return DataSets(train=systems_of("training_data"), valid=systems_of("validation_data"))


def check_samplers(config: dict, config_path: str, data: DataSets, world_size: int) -> None:
    """Batch sizes and system probabilities of both sections, checked before any statistics
    (the trainer builds the same samplers later)."""
    for section, systems in (("training_data", data.train), ("validation_data", data.valid)):
        if systems:
            try:
                make_sampler(systems, config["training"][section], 0, world_size, section)
            except MDTrainError as exc:
                raise MDTrainError(f"{config_path}: {exc}") from None


def validate_datasets(data: DataSets) -> None:
    """Every frame's coordinates, cells and labels are finite (one pass over the data, about
    0.05 s for 400 frames of 192 atoms): a NaN label would otherwise surface as a NaN loss
    after the statistics and possibly hours of training."""
    started = time.perf_counter()
    problems = []
    systems = data.train + data.valid
    for system, clean in zip(systems, clean_systems(systems), strict=True):
        if clean:  # nothing for validate_system to report
            continue
        try:
            problems += validate_system(system)
        except (OSError, ValueError) as exc:  # a damaged file that still opened
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            problems.append(f"system {system.path}: cannot be read ({text})")
    log.debug("data checked in %.3f s", time.perf_counter() - started)
    if problems:
        more = len(problems) - 1
        raise MDTrainError(
            problems[0]
            + (f" (and {more} more problem(s): `mdtrain check` lists all)" if more else "")
        )


def resolve_model_sel(
    config: dict,
    config_path: str,
    data: DataSets,
    neighbor_stat_file: str | None,
    skip_neighbor_stat: bool,
) -> dict:
    """Return a copy of the config whose descriptor ``sel`` is a list (one integer for a
    descriptor with one type-mixed neighbour list), from the statistics.

    Order of precedence: ``--skip-neighbor-stat`` (sel must already be a list), a neighbour-stat
    file (checked against rcut, type_map and the data), else a fresh computation (on rank 0,
    or split over the ranks: ``stat_mode``).
    """
    return resolve_sel_and_min_dist(
        config, config_path, data, neighbor_stat_file, skip_neighbor_stat
    )[0]


def resolve_sel_and_min_dist(
    config: dict,
    config_path: str,
    data: DataSets,
    neighbor_stat_file: str | None,
    skip_neighbor_stat: bool,
    collect: StatCollector | None = None,
) -> tuple[dict, float | None]:
    """``resolve_model_sel`` and the data's smallest interatomic distance (None where the
    statistics are skipped or found no pair): checkpoints keep it for DeePMD-kit's model
    file (``min_nbor_dist``). ``collect`` (see `stat_collector`) sees the frames searched."""
    config = copy.deepcopy(config)
    model = config["model"]
    found = []
    for where, holder, mixed in _sel_holders(model):
        one = _resolve_sel(
            config, config_path, data, neighbor_stat_file, skip_neighbor_stat,
            collect if where == "model.descriptor" else None, holder, where, mixed,
        )  # fmt: skip
        found.append(one)
    known = [d for d in found if d is not None]
    return config, (min(known) if known else None)


def _sel_holders(model: dict) -> list[tuple[str, dict, bool]]:
    """``(JSON path, section holding rcut and sel, type-mixed)`` of every neighbour list
    the model's ``sel`` sets: the descriptor, a hybrid's members, each part of a
    ``linear_ener`` model, a ``pairtab`` table (its ``sel`` counts all types together)."""
    holders = []
    for where, section in parts(model):
        if model_type(section) == PAIRTAB:
            holders.append((where, section, True))
            continue
        descriptor = section["descriptor"]
        members = descriptor_class(descriptor.get("type", "se_e2_a")).members_key
        for k, member in enumerate(descriptor[members] if members else [descriptor]):
            name = f"{where}.descriptor" + (f".{members}[{k}]" if members else "")
            holders.append((name, member, mixed_types(member)))
    return holders


def _resolve_sel(
    config: dict,
    config_path: str,
    data: DataSets,
    neighbor_stat_file: str | None,
    skip_neighbor_stat: bool,
    collect: StatCollector | None,
    holder: dict,
    where: str,
    mixed: bool,
) -> float | None:
    """``holder["sel"]`` made a list (``[total]`` where ``mixed``) from the neighbour
    statistics at ``holder["rcut"]``; the data's smallest distance (None when skipped)."""
    type_map, rcut = config["model"]["type_map"], float(holder["rcut"])
    parsed = parse_sel(holder["sel"])
    if skip_neighbor_stat:
        if isinstance(parsed, float):
            raise MDTrainError(
                f'{config_path}: {where}.sel is "{holder["sel"]}": '
                "--skip-neighbor-stat needs a list sel (an integer for se_atten and its kin)"
            )
        holder["sel"] = resolve_sel(parsed, [0], mixed) if mixed else parsed
        return None
    systems = data.train + data.valid
    stat_path = neighbor_stat_file or config["training"].get("neighbor_stat_file")
    if stat_path:
        stat_path = stat_path if neighbor_stat_file else resolve_path(config_path, stat_path)

        def from_file() -> tuple[float, list[int]]:
            stat = load_neighbor_stat(stat_path)
            check_neighbor_stat_matches(
                stat, rcut, type_map, systems, source=f"neighbour-stat file {stat_path}"
            )
            if mixed and "max_nbor_total" not in stat:
                raise MDTrainError(
                    f"neighbour-stat file {stat_path}: no max_nbor_total (written by an older "
                    "mdtrain): run mdtrain neighbor-stat again"
                )
            sizes = [stat["max_nbor_total"]] if mixed else stat["max_nbor_size"]
            return stat["min_nbor_dist"], sizes

        min_dist, max_size = dist_rt.run_on_main(from_file)
        log.info("neighbour statistics read from %s", stat_path)
    else:
        min_dist, max_size = neighbor_figures(
            systems, rcut, len(type_map), stat_mode(config), collect, mixed
        )
        if collect is not None:
            collect.searched(max_size)
    log.info("neighbour statistics: min distance %.6f Å, max neighbours %s", min_dist, max_size)
    if mixed and config["training"].get("strict_sel") and not isinstance(parsed, float):
        given = sum(parsed) if isinstance(parsed, list) else parsed
        if max_size[0] > given:
            raise MDTrainError(
                f"{config_path}: {where}.sel {holder['sel']} is smaller than the "
                f"data's largest neighbour count {max_size[0]} (all types together; "
                "training.strict_sel is true)"
            )
    elif isinstance(parsed, list) and config["training"].get("strict_sel"):
        short = [t for t, (s, n) in enumerate(zip(parsed, max_size)) if s and n > s]
        if short:
            raise MDTrainError(
                f"{config_path}: {where}.sel {parsed} is smaller than the data's "
                f"largest neighbour counts {max_size} for type(s) "
                + ", ".join(type_map[t] for t in short)
                + " (training.strict_sel is true)"
            )
    holder["sel"] = resolve_sel(holder["sel"], max_size, mixed)
    log.info("%s.sel = %s", where, holder["sel"])
    return float(min_dist) if math.isfinite(min_dist) else None


def neighbor_limit(
    config: dict, config_path: str, neighbor_stat_file: str | None, from_file: bool
) -> NeighborLimit | None:
    """What training checks every frame's neighbour counts against (`NeighborLimit`): the
    neighbour-stat file's ``max_nbor_size`` when the run took its statistics from one
    (``from_file``; a frame with more means the file does not describe the data), and
    ``sel`` under ``training.strict_sel`` (never a list cut short). None: neither, or a
    descriptor that mixes the types (its one sel counts them together)."""
    limits, sources = [], []
    training = config["training"]
    if "descriptor" not in config["model"] or mixed_list(config["model"]["descriptor"]):
        return None  # a type-mixed list, or linear_ener/pairtab: sel of several lists
    stat_path = neighbor_stat_file or training.get("neighbor_stat_file")
    if from_file and stat_path:
        stat_path = stat_path if neighbor_stat_file else resolve_path(config_path, stat_path)
        limits.append(list(load_neighbor_stat(stat_path)["max_nbor_size"]))
        sources.append(
            f"neighbour-stat file {stat_path}'s max_nbor_size {limits[-1]}: it does not "
            "describe these data, rerun mdtrain neighbor-stat"
        )
    descriptor = config["model"]["descriptor"]
    # a hybrid has no sel of its own: its members' were checked at their own rcut
    sel = parse_sel(descriptor["sel"]) if "sel" in descriptor else None
    if training.get("strict_sel") and isinstance(sel, list):
        limits.append(sel)
        sources.append(f"sel {sel} under training.strict_sel")
    if not limits:
        return None
    counts = [min((lim[t] or 1 << 30) for lim in limits) for t in range(len(limits[0]))]
    type_map = tuple(config["model"]["type_map"])
    return NeighborLimit(tuple(counts), " and ".join(sources), type_map)


def output_path(out_dir: str, name: str) -> str:
    return name if os.path.isabs(name) else os.path.join(out_dir, name)


# --------------------------------------------------------------------------------------------
# Statistics on rank 0, or shared by the ranks


def stat_mode(config: dict) -> str:
    """``training.distributed.stat_mode``: "rank0" (the default) or "shard"."""
    return str(config["training"].get("distributed", {}).get("stat_mode", "rank0"))


def neighbor_figures(
    systems: list[System],
    rcut: float,
    ntypes: int,
    mode: str,
    collect: StatCollector | None = None,
    mixed: bool = False,
) -> tuple[float, list[int]]:
    """The smallest neighbour distance and the largest neighbour counts of every frame of
    ``systems``, the same on every rank: computed on rank 0 and broadcast ("rank0"), or by
    every rank for its share of the frames, combined by ``combine_neighbor_partials``
    ("shard"; exact). ``mixed``: the counts are ``[all types together]``."""
    if mode != "shard" or dist_rt.get_world_size() == 1:

        def compute() -> tuple[float, list[int]]:
            visit = None if collect is None else collect.visit_frames
            stat = compute_neighbor_stat(
                systems, rcut, ntypes, fingerprints=False, visit_frames=visit
            )
            return stat.min_nbor_dist, [stat.max_nbor_total] if mixed else stat.max_nbor_size

        return dist_rt.run_on_main(compute)
    rank, world = dist_rt.get_rank(), dist_rt.get_world_size()
    rows = share_ranges([(int(s.nframes), int(s.natoms)) for s in systems], rank, world)
    mine = neighbor_stat_partial(
        systems, rcut, ntypes, rank == 0, rows=rows, desc="neighbour statistics (rank 0's share)"
    )
    log.debug("neighbour statistics: %d of the frames searched here", int(mine.searched.sum()))
    combined = combine_neighbor_partials(mine)
    stat = neighbor_stat_result(systems, rcut, combined, fingerprints=False, report=rank == 0)
    return stat.min_nbor_dist, [stat.max_nbor_total] if mixed else stat.max_nbor_size


_REDUCE = {
    "min": dist_rt.all_reduce_min,
    "max": dist_rt.all_reduce_max,
    "sum": dist_rt.all_reduce_sum,
}


def combine_neighbor_partials(partial: NeighborPartial) -> NeighborPartial:
    """Every rank's partial statistics combined, field by field, with the collective that
    ``NeighborPartial.COMBINE`` names (exact for minima, maxima and integer sums)."""
    out = {}
    for field in fields(partial):
        tensor = torch.from_numpy(np.array(getattr(partial, field.name)))
        out[field.name] = _REDUCE[NeighborPartial.COMBINE[field.name]](tensor).numpy()
    return NeighborPartial(**out)


def _total(array: np.ndarray) -> np.ndarray:
    """``array`` summed over the ranks (float64)."""
    tensor = torch.from_numpy(np.array(array, dtype=np.float64))
    return dist_rt.all_reduce_sum(tensor).numpy()


def stat_collector(
    config: dict, data: DataSets, stat_file: str | None, device: torch.device
) -> StatCollector | None:
    """A collector of the descriptor statistics for the neighbour-statistics pass, where
    that pass and the data statistics both run in this process: rank 0 ("rank0" mode, or
    one rank), no stat file yet (whose statistics would be used instead)."""
    if not dist_rt.is_main_process() or (stat_file and os.path.exists(stat_file)):
        return None
    if stat_mode(config) == "shard" and dist_rt.get_world_size() > 1:
        return None
    descriptor = config["model"].get("descriptor")  # none in linear_ener and pairtab models
    if descriptor is None or not descriptor_class(descriptor.get("type")).gathers_stats_in_search:
        return None
    nbatch = int(config["model"].get("data_stat_nbatch", 10))
    return StatCollector(data.train, config["model"], nbatch, device)


def model_statistics(
    model,
    systems: list[System],
    stat_file: str | None,
    nbatch: int,
    mode: str,
    collected: StatCollector | None = None,
) -> None:
    """The model's davg/dstd and energy bias (``compute_or_load_stats``): computed on rank 0
    ("rank0"; the caller broadcasts the model), or by every rank for its share of the
    statistics batches, combined by sums ("shard"; every rank's model gets them). The stat
    file is read and written by rank 0 either way. ``collected``: sums gathered during the
    neighbour statistics (`stat_collector`)."""
    if mode != "shard" or dist_rt.get_world_size() == 1:
        compute = functools.partial(compute_or_load_stats, presummed=collected)
        dist_rt.run_on_main(compute, model, systems, stat_file, nbatch)
        return
    share = StatShare(
        rank=dist_rt.get_rank(),
        world=dist_rt.get_world_size(),
        total=_total,
        on_main=dist_rt.run_on_main,
    )
    compute_or_load_stats(model, systems, stat_file, nbatch, share=share)
