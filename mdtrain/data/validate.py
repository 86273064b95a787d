"""Content checks of a system's frames, for ``mdtrain check``: NaN/inf values, singular cells.

Opening a system already checks its layout (files, shapes, frame counts); these checks read
every frame, set by set in chunks, so they cost one pass over the data.
"""

from __future__ import annotations

import numpy as np

from mdtrain.data.system import System

_SHOWN = 5  # frame indices quoted per problem


def validate_system(system: System, chunk: int = 2000) -> list[str]:
    """Problems found in the frames of ``system``, one line each (empty when clean)."""
    bad: dict[str, list[int]] = {}
    for start in range(0, system.nframes, chunk):
        index = np.arange(start, min(start + chunk, system.nframes))
        data = system.frames(index)
        for name, values in data.items():
            finite = np.isfinite(values.reshape(len(index), -1)).all(axis=1)
            bad.setdefault(f"{name} holds NaN or inf", []).extend(index[~finite].tolist())
        if "box" in data:
            with np.errstate(invalid="ignore"):
                volume = np.abs(np.linalg.det(data["box"]))
            singular = volume < 1e-6
            bad.setdefault("box is singular (zero volume)", []).extend(index[singular].tolist())
    problems = []
    for what, frames in bad.items():
        if frames:
            shown = ", ".join(str(f) for f in frames[:_SHOWN])
            more = f", ... ({len(frames)} frames)" if len(frames) > _SHOWN else ""
            problems.append(f"system {system.path}: {what} in frame {shown}{more}")
    return problems
