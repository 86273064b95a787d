"""A committee evaluated on frames, and ``model_devi.out`` (for ``mdtrain model-devi``).

Frames are evaluated in memory-adaptive chunks (``InferenceChunker``: a chunk that runs out
of memory is halved and retried; only a single frame too big for the device is an error,
naming the system), and ``committee_model_devi`` keeps only each chunk's deviations, never
every model's forces on every frame. Within a chunk the neighbour lists are
built once per distinct ``(rcut, sel)`` among the models and shared by the models that have
it: a committee trained together has one, so every frame's list is built once for all
members; models with other cut-offs or ``sel`` get lists of their own (a list for a larger
cut-off is not a list for a smaller one: its padding and truncation differ).

The deviations and the file follow DeePMD-kit 3.2 (`mdtrain.infer.deviation`); per-atom
columns (``--atomic``) are in the atoms' order in the file read, as DeePMD's are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import IO, Any

import numpy as np
import torch

from mdtrain.data import System
from mdtrain.data.params import ParamSpec, read_params
from mdtrain.data.trajectory import TrajectoryFrames
from mdtrain.errors import MDTrainError
from mdtrain.infer.deviation import (
    Deviation,
    committee_deviation,
    model_devi_header,
    model_devi_rows,
)
from mdtrain.infer.finite import check_predictions
from mdtrain.memory import InferenceChunker
from mdtrain.neighbors.layout import ListLayout, layout_of

Frames = System | TrajectoryFrames


@dataclass
class CommitteeOutput:
    """Every model's predictions on some frames; atoms in the file's order."""

    energy: np.ndarray  # (nmodels, nframes)
    force: np.ndarray  # (nmodels, nframes, natoms, 3)
    virial: np.ndarray  # (nmodels, nframes, 3, 3)


def neighbor_groups(
    models: list[torch.nn.Module],
) -> list[tuple[float, list[int], ListLayout, list[int]]]:
    """``(rcut, sel, layout, model indices)`` for each distinct neighbour list the models
    need."""
    groups: dict[tuple[float, tuple[int, ...], ListLayout], list[int]] = {}
    for k, model in enumerate(models):
        key = (float(model.rcut), tuple(int(s) for s in model.sel), layout_of(model))
        groups.setdefault(key, []).append(k)
    return [(rcut, list(sel), lay, members) for (rcut, sel, lay), members in groups.items()]


def evaluate_committee(
    models: list[torch.nn.Module],
    source: Frames,
    device: torch.device | str = "cpu",
    chunker: InferenceChunker | None = None,
    on_frames: Callable[[int], None] | None = None,
    names: list[str] | None = None,
) -> CommitteeOutput:
    """Every model's energy, forces and virial on every frame of ``source``.

    ``on_frames(n)`` is called after each chunk (progress); ``chunker`` carries its learned
    chunk size from one source to the next; ``names`` label the models in errors (a
    non-finite prediction is one, `mdtrain.infer.finite`).
    """
    chunks = _over_chunks(models, source, device, chunker, on_frames, lambda out: out, names)
    return CommitteeOutput(
        *(np.concatenate([getattr(c, key) for c in chunks], axis=1) for key in _KEYS)
    )


def committee_model_devi(
    models: list[torch.nn.Module],
    source: Frames,
    device: torch.device | str = "cpu",
    chunker: InferenceChunker | None = None,
    on_frames: Callable[[int], None] | None = None,
    relative: float | None = None,
    relative_v: float | None = None,
    names: list[str] | None = None,
) -> Deviation:
    """The model deviations on every frame of ``source``, as `evaluate_committee` then
    `deviation_of`, chunk by chunk: only the deviations of all frames are kept, never every
    model's forces (a long trajectory of big frames would not fit)."""
    chunks = _over_chunks(
        models,
        source,
        device,
        chunker,
        on_frames,
        lambda out: deviation_of(out, relative, relative_v),
        names,
    )
    return Deviation(
        *(np.concatenate([getattr(c, f.name) for c in chunks]) for f in fields(Deviation))
    )


_KEYS = ("energy", "force", "virial")


def _over_chunks(
    models: list[torch.nn.Module],
    source: Frames,
    device: torch.device | str,
    chunker: InferenceChunker | None,
    on_frames: Callable[[int], None] | None,
    reduce: Callable[[CommitteeOutput], Any],
    names: list[str] | None = None,
) -> list:
    """``reduce(CommitteeOutput)`` of each chunk of frames, in order (the module docstring
    says how chunks and neighbour lists are made)."""
    chunker = chunker or InferenceChunker(device=device)
    groups = neighbor_groups(models)
    nmodels, natoms = len(models), source.natoms
    atype = torch.as_tensor(source.atype, dtype=torch.long, device=device)
    spec = ParamSpec.of_model(models[0])
    if spec.any and not hasattr(source, "has"):
        raise MDTrainError(
            f"{source.path}: the model takes frame/atomic parameters, which model-devi reads "
            "from deepmd systems only (fparam.npy, aparam.npy)"
        )

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

    def run(start: int, stop: int) -> Any:
        frames = source.frames(np.arange(start, stop))
        coord, boxes = frames["coord"], frames.get("box")
        nf = stop - start
        energy = np.empty((nmodels, nf))
        force = np.empty((nmodels, nf, natoms, 3))
        virial = np.empty((nmodels, nf, 3, 3))
        x = tensor(coord, torch.float64)
        box = None if boxes is None else tensor(boxes, torch.float64)
        params = [
            None if p is None else tensor(p, torch.float64)
            for p in read_params(source, frames, nf, spec)
        ]
        for rcut, sel, layout, members in groups:
            lists = [
                layout.build(coord[f], None if boxes is None else boxes[f], source.atype, rcut, sel)
                for f in range(nf)
            ]
            nlist = tensor(np.stack([nl for nl, _, _ in lists]), torch.long)
            shift = tensor(np.stack([sh for _, sh, _ in lists]), torch.float64)
            for k in members:
                with torch.enable_grad():  # forces are derivatives (TorchScript cannot enable it)
                    out = models[k](x, atype, box, nlist, shift, *(params if spec.any else []))
                energy[k] = out["energy"].detach().cpu().numpy()
                # back to the file's order of the atoms
                force[k][:, source.atom_order] = out["force"].detach().cpu().numpy()
                virial[k] = out["virial"].detach().cpu().numpy()
                del out
                name = f"model {names[k] if names else k}"
                check_predictions(
                    {"energy": energy[k], "force": force[k], "virial": virial[k]},
                    name, source.path, int(getattr(source, "first", 0)) + start,
                )  # fmt: skip
        result = reduce(CommitteeOutput(energy=energy, force=force, virial=virial))
        if on_frames is not None:
            on_frames(nf)
        return result

    return chunker.run_all(run, source.nframes, natoms, name=source.path)


def deviation_of(
    output: CommitteeOutput, relative: float | None = None, relative_v: float | None = None
) -> Deviation:
    """The model deviations of a committee's predictions (`mdtrain.infer.deviation`)."""
    return committee_deviation(output.energy, output.force, output.virial, relative, relative_v)


def frame_steps(source: Frames, frequency: int | None = None) -> np.ndarray:
    """The ``step`` column: DeePMD's frame index × ``frequency`` (index within a system, or
    within the whole file for a trajectory); without ``frequency``, a LAMMPS dump's own
    timesteps where it has them, else the index."""
    timesteps = getattr(source, "timesteps", None)
    if frequency is None and timesteps is not None:
        return np.asarray(timesteps, dtype=np.int64)
    first = getattr(source, "first", 0)
    return (np.arange(source.nframes, dtype=np.int64) + first) * (frequency or 1)


def write_model_devi(
    handle: IO[str], title: str, steps: np.ndarray, deviation: Deviation, atomic: bool = False
) -> None:
    """One system's block of ``model_devi.out``: DeePMD's two header lines, then its rows."""
    handle.write(model_devi_header(title, atomic))
    handle.write(model_devi_rows(steps, deviation.columns(atomic)))


def trust_counts(max_devi_f: np.ndarray, trust_lo: float, trust_hi: float) -> dict[str, int]:
    """dpgen-style selection by ``max_devi_f``: accurate below ``trust_lo``, candidate from
    ``trust_lo`` up to (not including) ``trust_hi``, failed from ``trust_hi`` on."""
    values = np.asarray(max_devi_f)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:  # counted nowhere otherwise: every frame is in exactly one count
        raise MDTrainError(
            f"max_devi_f is not finite on {bad.size} frame(s) (the first: frame {int(bad[0])}); "
            "no frame is left out of the trust counts"
        )
    return {
        "accurate": int((values < trust_lo).sum()),
        "candidate": int(((values >= trust_lo) & (values < trust_hi)).sum()),
        "failed": int((values >= trust_hi).sum()),
    }
