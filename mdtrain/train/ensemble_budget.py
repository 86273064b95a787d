"""What a committee of N members will cost, estimated before anything is created: memory
(weights, gradients and Adam state of every member, and one batch's activations each),
open files (every member keeps its ``lcurve.out`` open) and time per step. What cannot fit
is refused with the figures; the time is logged (a warning when a step would take minutes).

The estimate is deliberately rough (within a factor of a few): it exists to stop
``--ensemble 1000`` on a laptop before a thousand folders and models are made, not to
plan a run. Memory and the file limit are read from the system (``available_memory``,
``open_file_limit``; tests replace them).
"""

from __future__ import annotations

import copy
import logging
import math
import resource
from dataclasses import dataclass

import torch

from mdtrain.config.model_kind import network_sections
from mdtrain.errors import MDTrainError
from mdtrain.model.energy import EnergyModel
from mdtrain.neighbors.sel import parse_sel
from mdtrain.train.prepare import open_datasets

log = logging.getLogger("mdtrain")

#: Files a run keeps open besides the members' lcurve.out (logs, data, libraries).
OTHER_FILES = 64
#: Of the memory reported free, the share a committee may plan to use.
USABLE_SHARE = 0.9
#: Rough throughput (floating-point operations per second) and per-member overhead of a
#: training step, for the time estimate; measured order of magnitude, not a promise.
CPU_RATE, CUDA_RATE, MEMBER_OVERHEAD_S = 5e9, 5e11, 5e-3
#: Copies of every parameter while training: weights, gradient, Adam's two moments.
PARAMETER_COPIES = 4
#: Stored values per activation (forward value, tanh derivative, gradient).
ACTIVATION_COPIES = 3


@dataclass
class MemberCost:
    """One member's share: bytes while training and floating-point operations per step."""

    nbytes: int
    flops: float
    nparams: int
    exact: bool  # False where sel is "auto" (not known yet): then a lower bound


def member_cost(model_config: dict, batch_atoms: int) -> MemberCost:
    """The training cost of one member of ``model_config`` on batches of ``batch_atoms``
    atoms (all frames of a batch together)."""
    descriptor, fitting = model_config["descriptor"], model_config["fitting_net"]
    ntypes = len(model_config["type_map"])
    sel = parse_sel(descriptor.get("sel", "auto"))
    nnei = sum(sel) if isinstance(sel, list) else 0
    precision = str(descriptor.get("precision", "float64"))
    itemsize = 4 if precision in ("float32", "bfloat16") else 8
    embed = [1, *descriptor.get("neuron", [25, 50, 100])]
    embed_params = sum(a * b + b for a, b in zip(embed, embed[1:]))
    fit = [embed[-1] * int(descriptor.get("axis_neuron", 4)), *fitting.get("neuron", []), 1]
    fit_params = sum(a * b + b for a, b in zip(fit, fit[1:]))
    nparams = count_parameters(model_config)
    activations = batch_atoms * (nnei * sum(embed) + sum(fit))
    nbytes = itemsize * (
        PARAMETER_COPIES * nparams
        + ACTIVATION_COPIES * activations
        + 2 * ntypes * nnei * 4  # davg, dstd
    )
    # forward, backward and the force derivative: about three passes of 2 flops a weight
    flops = 6.0 * batch_atoms * (nnei * embed_params + fit_params)
    return MemberCost(int(nbytes), flops, nparams, isinstance(sel, list))


def model_cost(model_config: dict, batch_atoms: int) -> MemberCost:
    """`member_cost` of a model, summed over a combined model's network parts (its tables
    cost next to nothing)."""
    type_map = model_config["type_map"]
    costs = [member_cost({**n, "type_map": type_map}, batch_atoms)
             for _, n in network_sections(model_config)]  # fmt: skip
    return MemberCost(
        sum(c.nbytes for c in costs),
        sum(c.flops for c in costs),
        sum(c.nparams for c in costs),
        all(c.exact for c in costs),
    )


def count_parameters(model_config: dict) -> int:
    """The parameters of one member, counted on a model built on the meta device (no
    memory; the count does not depend on ``sel``, which may not be known yet)."""
    config = copy.deepcopy(model_config)
    desc = config["descriptor"]
    for section in desc["list"] if desc.get("type") == "hybrid" else [desc]:  # its members
        if not isinstance(parse_sel(section.get("sel", "auto")), list):
            section["sel"] = [1] * len(config["type_map"])
    with torch.device("meta"):
        return sum(p.numel() for p in EnergyModel(config).parameters())


def available_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` (a GPU's free memory; on the CPU the smaller of the
    system's available memory and the cgroup's room), None where it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as handle:
            limit = handle.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as handle:
            used = int(handle.read().strip())
        if limit != "max":
            room = int(limit) - used
            free = room if free is None else min(free, room)
    except (OSError, ValueError):
        pass
    return free


def open_file_limit() -> int | None:
    """The soft limit on open files (``ulimit -n``), None where there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def batch_atoms(training: dict, natoms: list[int]) -> int:
    """Atoms in one training batch of the largest system (``batch_size`` a number, "auto"
    or "auto:N": DeePMD's rule, at least N atoms, 32 by default)."""
    largest = max(natoms, default=1)
    size = training.get("training_data", {}).get("batch_size", "auto")
    if isinstance(size, int):
        return size * largest
    if isinstance(size, list) and size:
        return int(max(size)) * largest
    text = str(size)
    want = int(text.split(":", 1)[1]) if text.startswith("auto:") else 32
    return max(1, math.ceil(want / largest)) * largest


def check_ensemble(size: int, config: dict, input_path: str, device: torch.device) -> None:
    """Refuse a committee of ``size`` whose memory or open files cannot fit (one line with
    the figures); log the estimate, and warn when a step would take minutes. The systems
    are opened (no frame read) for their sizes."""
    if size <= 1:
        return
    natoms = [int(s.natoms) for s in open_datasets(config, input_path).train]
    steps = int(config["training"]["numb_steps"])
    atoms = batch_atoms(config["training"], natoms)
    cost = model_cost(config["model"], atoms)
    total = size * cost.nbytes
    bound = "about " if cost.exact else "at least "
    free = available_memory(device)
    if free is not None and total > USABLE_SHARE * free:
        fits = max(1, int(USABLE_SHARE * free // max(cost.nbytes, 1)))
        raise MDTrainError(
            f"--ensemble {size}: {bound}{_size(total)} of memory needed ({_size(cost.nbytes)} a member: "
            f"{cost.nparams} parameters with gradients and Adam state, activations of "
            f"{atoms} atoms), {_size(free)} free on {device}; at most about {fits} members fit "
            "in one run (nothing was created)"
        )
    limit = open_file_limit()
    if limit is not None and size + OTHER_FILES > limit:
        raise MDTrainError(
            f"--ensemble {size}: about {size + OTHER_FILES} open files needed (an lcurve.out a "
            f"member), the limit is {limit} (ulimit -n); raise it or train at most "
            f"{max(1, limit - OTHER_FILES)} members in one run (nothing was created)"
        )
    rate = CUDA_RATE if device.type == "cuda" else CPU_RATE * max(1, torch.get_num_threads())
    per_step = size * (cost.flops / rate + MEMBER_OVERHEAD_S)
    message = (
        f"committee of {size}: {bound}{_size(total)} and about {_duration(per_step)} a step "
        f"({_duration(per_step * steps)} for {steps} steps; a rough estimate)"
    )
    if per_step > 60 or per_step * steps > 86400:
        log.warning("%s: consider fewer members per run", message)
    else:
        log.info("%s", message)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.3g} TiB"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.2g} s"
    if seconds < 7200:
        return f"{seconds / 60:.2g} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.2g} h"
    return f"{seconds / 86400:.2g} days"
