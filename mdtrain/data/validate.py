"""Content checks of a system's frames, for ``mdtrain check``: NaN/inf values, singular cells.

Opening a system already checks its layout (files, shapes, frame counts); these checks read
every frame, set by set in chunks, so they cost one pass over the data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mdtrain.data.system import EXTRA_LABELS, PARAMS, TENSOR_LABELS, System
from mdtrain.errors import MDTrainError

_SHOWN = 5  # frame indices quoted per problem


def validate_system(system: System, chunk: int = 2000) -> list[str]:
    """Problems found in the frames of ``system``, one line each (empty when clean).

    The arrays are checked as stored, set by set in chunks of frames (no atom reordering,
    no conversion: thousands of small systems make the per-call costs count).
    """
    names = ["coord"] + (["box"] if system.periodic else []) + sorted(system.labels)
    bad: dict[str, list[int]] = {}
    for info in system.sets:
        for start in range(0, info.nframes, chunk):
            rows = np.arange(start, min(start + chunk, info.nframes))
            index = system.source_frames(info, rows)
            for name in names:
                values = system.stored_rows(info, name, rows)
                finite = np.isfinite(values).all(axis=1)
                if not finite.all():
                    bad.setdefault(f"{name} holds NaN or inf", []).extend(index[~finite].tolist())
                if name == "box":
                    with np.errstate(invalid="ignore"):
                        volume = np.abs(np.linalg.det(values.reshape(-1, 3, 3).astype(float)))
                    singular = volume < 1e-6
                    if singular.any():
                        what = "box is singular (zero volume)"
                        bad.setdefault(what, []).extend(index[singular].tolist())
    problems = []
    for what in sorted(bad, key=_rank):
        frames = sorted(set(bad[what]))
        shown = ", ".join(str(f) for f in frames[:_SHOWN])
        more = f", ... ({len(frames)} frames)" if len(frames) > _SHOWN else ""
        problems.append(f"system {system.path}: {what} in frame {shown}{more}")
    return problems


_FAST_VALUES = 1 << 16  # systems with at most this many values per array join the pass


def clean_systems(systems: Sequence[System]) -> list[bool]:
    """Whether each system certainly passes `validate_system`, from one pass over all of
    them: every array read as stored and tested for NaN/inf together, every cell's volume
    by one determinant call (thousands of small systems otherwise cost a few numpy calls
    per array each). False: to be checked on its own by `validate_system`, which names the
    problem (a large system, a value that is not finite, a singular cell, a failed read)."""
    clean = [True] * len(systems)
    values: list[np.ndarray] = []
    owner: list[int] = []
    boxes: list[np.ndarray] = []
    box_owner: list[int] = []
    for k, system in enumerate(systems):
        if system.nframes * system.natoms * 3 > _FAST_VALUES:
            clean[k] = False
            continue
        names = ["coord"] + (["box"] if system.periodic else []) + sorted(system.labels)
        first, first_box = len(values), len(boxes)
        try:
            for info in system.sets:
                rows = np.arange(info.nframes)
                for name in names:
                    block = system.stored_rows(info, name, rows)
                    values.append(block.reshape(-1))
                    if name == "box":
                        boxes.append(block.reshape(-1, 3, 3))
        except (OSError, ValueError, MDTrainError):  # validate_system's read reports it
            clean[k] = False
            del values[first:], boxes[first_box:]
            continue
        owner.extend([k] * (len(values) - first))
        box_owner.extend([k] * (len(boxes) - first_box))
    sizes = np.array([len(v) for v in values], dtype=np.int64)
    if len(values) and sizes.all():
        finite = np.isfinite(np.concatenate(values))
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        for k in np.asarray(owner)[~np.logical_and.reduceat(finite, starts)].tolist():
            clean[k] = False
    else:  # an empty array somewhere: array by array
        for k, block in zip(owner, values, strict=True):
            clean[k] = clean[k] and bool(np.isfinite(block).all())
    if boxes:
        with np.errstate(invalid="ignore"):
            volume = np.abs(np.linalg.det(np.concatenate(boxes).astype(float)))
        counts = [len(b) for b in boxes]
        for k in set(np.repeat(box_owner, counts)[~(volume >= 1e-6)].tolist()):
            clean[k] = False  # singular, or not a number (reported as such)
    return clean


_ORDER = [
    *(
        f"{name} holds NaN or inf"
        for name in (
            "coord",
            "box",
            "energy",
            "force",
            "virial",
            *EXTRA_LABELS,
            *TENSOR_LABELS,
            *PARAMS,
        )
    ),
    "box is singular (zero volume)",
]


def _rank(what: str) -> int:
    """A problem's place in the report: `_ORDER`'s; a model's own labels before the cell."""
    return _ORDER.index(what) if what in _ORDER else len(_ORDER) - 1
