"""Content checks of a system's frames, for ``mdtrain check``: NaN/inf values, singular cells.

Opening a system already checks its layout (files, shapes, frame counts); these checks read
every frame, set by set in chunks, so they cost one pass over the data.
"""

from __future__ import annotations

import numpy as np

from mdtrain.data.system import EXTRA_LABELS, PARAMS, TENSOR_LABELS, System

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
