"""Model statistics, the one orchestrator: the descriptor's davg/dstd and the energy bias,
from the stat file where it holds them, else from one streamed pass over the sampled frames.

Descriptor statistics (DeePMD-compatible) are the descriptor's own: for each centre type t,
over all its atoms and all ``sum(sel)`` slots *including padding zeros*, each of its
``stat_groups`` (se_e2_a: the radial column ``r``, the three angular columns pooled ``a``)
accumulates [number, sum, squared_sum], summed over systems; ``stats_from_items`` turns
them into davg/dstd. The energy bias is the least-squares solution of ``N_types · bias = E``
over the sampled frames (``energy_bias.py``); its residual std is stored for every type.

Ranks may split the work (``StatShare``): each takes a contiguous share of the batches, the
descriptor sums are added up, and the energy bias is solved from the stacked QR factors of
every rank's rows. One process runs the same code with a share of one.

The numbers are cached in ``training.stat_file`` (layout in ``model/stat_file.py``). The data
themselves are not hashed (as in DeePMD): delete the file after changing the systems.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mdtrain.model.descriptors import StatItem
from mdtrain.model.stat_file import (
    DATA_ATTR,
    data_summary,
    descriptor_stat_hash,
    output_stat_hash,
    read_stat_file_and_attrs,
    write_stat_file,
)
from mdtrain.model.stats.collector import StatCollector
from mdtrain.model.stats.energy_bias import compute_energy_bias
from mdtrain.model.stats.output_stats import output_stats
from mdtrain.model.stats.pairs import PairStatSums
from mdtrain.model.stats.params import set_param_stats
from mdtrain.model.stats.sampling import my_stat_plan, stat_frames
from mdtrain.model.stats.share import ALONE, StatShare
from mdtrain.model.stats.tensor_bias import tensor_out_bias

log = logging.getLogger("mdtrain.model.stats")


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

    ntypes = len(model.type_map)
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

    A model without a descriptor of its own (``linear_ener``, ``pairtab``) is DeePMD-kit's
    linear model: each network part gets its descriptor statistics (its own bias stays 0),
    and the whole gets one energy bias, fitted to the labels alone (the parts' energies are
    not subtracted, as DeePMD-kit's ``set-by-statistic`` does).

    Missing entries are computed in one streamed pass (``stream_stat_inputs``) over the
    first ``nbatch`` batches of every system (``stat_batch_plan``) and, when ``stat_file``
    is given, written back to it; descriptor sums a `StatCollector` gathered during the
    neighbour statistics are used when they fit the model. With a ``share`` of
    several ranks every rank calls this: each computes its share of the batches, the sums
    are combined, and every rank's model gets the same statistics; rank 0 alone reads and
    writes the file.
    """
    if not hasattr(model, "descriptor"):
        for part in model.parts:
            if hasattr(part, "descriptor"):
                _model_stats(
                    part, systems, stat_file, nbatch, batch_size, share, None, energy_bias=False
                )
        _model_stats(model, systems, stat_file, nbatch, batch_size, share, None, items=False)
        return
    _model_stats(model, systems, stat_file, nbatch, batch_size, share, presummed)


def _model_stats(
    model,
    systems: Sequence[Any],
    stat_file: str | None,
    nbatch: int,
    batch_size: int | None,
    share: StatShare,
    presummed: StatCollector | None,
    items: bool = True,
    energy_bias: bool = True,
) -> None:
    """`compute_or_load_stats` of one model: its descriptor statistics (``items``) and its
    energy bias (``energy_bias``)."""
    desc = model.descriptor if items else None
    ntypes = len(model.type_map)
    report = share.rank == 0
    root = " ".join(model.type_map)
    dkey = f"{root}/{descriptor_stat_hash(model)}" if items else root
    stored, attrs = share.on_main(read_stat_file_and_attrs, stat_file) if stat_file else ({}, {})
    summary = data_summary(systems)
    if stored and attrs.get(DATA_ATTR) not in (None, summary) and report:
        log.warning(
            "%s holds statistics of other training data (other system sizes): they are "
            "used as they are; delete the file to compute them from this data",
            stat_file,
        )
    new: dict[str, np.ndarray] = {}
    names = [f"{k}_{t}" for t in range(ntypes) for k in desc.stat_groups] if items else []
    bkey, skey = f"{root}/bias_atom_energy", f"{root}/std_atom_energy"
    have_items = all(f"{dkey}/{n}" in stored for n in names)
    own_output = getattr(model, "kind", None) in ("dos", "property")  # its own statistics
    have_bias = (bkey in stored and skey in stored) or bool(getattr(model, "tensor_size", 0))
    have_bias = have_bias or own_output or not energy_bias
    plan = my_stat_plan(systems, nbatch, batch_size, share)
    fitting = getattr(model, "fitting", None)
    if getattr(fitting, "numb_fparam", 0) or getattr(fitting, "numb_aparam", 0):
        protect = float(model.get_model_config()["data_stat_protect"])
        set_param_stats(model, systems, plan, protect, share)
    if not (have_items and have_bias):  # one pass over the sampled frames for both
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
    if desc is not None:
        if have_items:
            found = {n: StatItem.from_array(stored[f"{dkey}/{n}"]) for n in names}
            log.info("descriptor statistics loaded from %s", stat_file)
        else:
            sums = share.total(np.stack([mine[n].to_array() for n in names]))
            found = {n: StatItem.from_array(row) for n, row in zip(names, sums, strict=True)}
            new.update({f"{dkey}/{n}": item.to_array() for n, item in found.items()})
        davg, dstd = desc.stats_from_items(found)
        desc.set_stats(torch.from_numpy(davg), torch.from_numpy(dstd))
    if own_output:  # every rank takes every sampled frame: the same statistics everywhere
        okey = f"{root}/{output_stat_hash(model)}"
        obkey, oskey = f"{okey}/bias_atom_{model.output}", f"{okey}/std_atom_{model.output}"
        if obkey in stored and oskey in stored:
            bias, std = stored[obkey], stored[oskey]
            log.info("%s output statistics loaded from %s", model.output, stat_file)
        else:
            rcond = model.get_model_config()["fitting_net"].get("rcond")
            plan_all = my_stat_plan(systems, nbatch, batch_size)
            bias, std = output_stats(model, systems, plan_all, rcond)
            new[obkey], new[oskey] = bias, std
        model.out_bias.copy_(torch.from_numpy(bias))
        model.out_std.copy_(torch.from_numpy(std))
        if report:
            log.info("%s output bias per type (mean over values): %s", model.output, bias.mean(1))
    if getattr(model, "tensor_size", 0) or own_output:  # their own output bias
        if model.kind == "polar":
            bias = tensor_out_bias(model, systems, my_stat_plan(systems, nbatch, batch_size))
            model.out_bias.copy_(torch.from_numpy(bias))
            log.info("polarizability bias (mean diagonal) per type: %s", bias[:, ::4].mean(1))
        if stat_file and new:
            share.on_main(write_stat_file, stat_file, new, {DATA_ATTR: summary})
        return

    if not energy_bias:  # a part of a linear model: the whole has the bias
        if stat_file and new:
            share.on_main(write_stat_file, stat_file, new, {DATA_ATTR: summary})
        return
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
                counts * keep, energies, _rcond(model.get_model_config()), share
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


def _rcond(model_config: dict) -> float | None:
    """The energy bias's ``rcond``: the fitting net's; None for a linear model (DeePMD-kit's)."""
    return (model_config.get("fitting_net") or {}).get("rcond")
