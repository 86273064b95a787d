"""``mdtrain test -d PREFIX`` of a DOS or property model: DeePMD-kit 3.2's detail files of
those models (``deepmd/infer/model_test/dos.py``, ``property.py``: one file per frame).

For frame ``f`` of the ``k``-th tested system, ``PREFIX`` with its last suffix replaced by
``.dos.out.f`` (``.dos.out.k.f`` for k > 0), holding the frame's ``numb_dos`` reference
values in one column and the predicted ones in another, under the header ``# <system> - f:
data_dos pred_dos``; a property model writes ``.property.out...`` (``task_dim`` rows). A
system with atomic labels (``atom_dos.npy``, ``atom_<property_name>.npy``) also gets
``.ados.out...`` / ``.aproperty.out...`` (natoms x values rows, atoms in the system's file
order), the files ``dp test -a`` writes. ``numpy.savetxt``'s ``%.18e``, as DeePMD-kit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mdtrain.data import System
from mdtrain.errors import MDTrainError
from mdtrain.infer.test import SystemResult

# result key -> file suffix (DeePMD-kit's)
SUFFIXES = {"dos": "dos", "atom_dos": "ados", "property": "property", "atom_property": "aproperty"}


def write_output_details(
    prefix: str, result: SystemResult, system: System, name: str, group: int
) -> None:
    """The per-frame files of the ``group``-th tested system, called ``name`` in the
    headers."""
    back = np.empty_like(system.atom_order)  # the model's atom order -> the file's
    back[system.atom_order] = np.arange(system.natoms)
    for key, suffix in SUFFIXES.items():
        if key not in result.label:
            continue
        ref, pred = result.label[key], result.pred[key]
        if key.startswith("atom_"):
            n = result.nframes
            ref = ref.reshape(n, system.natoms, -1)[:, back]
            pred = pred.reshape(n, system.natoms, -1)[:, back]
        middle = f".{group}" if group else ""
        for frame in range(result.nframes):
            path = Path(prefix).with_suffix(f".{suffix}.out{middle}.{frame}")
            rows = np.column_stack([ref[frame].reshape(-1), pred[frame].reshape(-1)])
            header = f"{name} - {frame}: data_{suffix} pred_{suffix}"
            try:
                with path.open("w", encoding="utf-8") as handle:
                    np.savetxt(handle, rows, header=header)
            except OSError as exc:
                raise MDTrainError(f"-d {path}: cannot write ({exc.strerror or exc})") from None
