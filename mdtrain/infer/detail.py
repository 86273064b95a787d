"""``mdtrain test -d PREFIX``: DeePMD-kit 3.2's per-frame detail files, which users' scripts
parse, in its layout (``deepmd/infer/model_test/ener.py``, ``dp test -d``).

Files (``PREFIX`` with its last suffix replaced, as ``pathlib.Path.with_suffix`` does):
``.e.out`` (reference and predicted energy per frame), ``.e_peratom.out`` (the same divided
by N), ``.f.out`` (one row per atom: reference then predicted force, atoms in the system's
file order), ``.v.out`` and ``.v_peratom.out`` (the 9 virial components, reference then
predicted), and ``.s.out`` (the stress ``-virial / volume``, for periodic systems with a
virial label). Each is written by ``numpy.savetxt`` (``%.18e``, one space) under a
``# <system>: data_... pred_...`` header. The first system starts the files; later systems
are appended without a header of their own (DeePMD-kit writes a header only into an empty
file). A label the system lacks is written as zeros, as DeePMD-kit does.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mdtrain.data import System
from mdtrain.errors import MDTrainError
from mdtrain.infer.test import SystemResult

SUFFIXES = (".e.out", ".e_peratom.out", ".f.out", ".v.out", ".v_peratom.out", ".s.out")
_V = ("xx", "xy", "xz", "yx", "yy", "yz", "zx", "zy", "zz")


def detail_paths(prefix: str) -> list[str]:
    """Every file ``-d prefix`` may write (to check them before any work)."""
    return [str(Path(prefix).with_suffix(s)) for s in SUFFIXES]


def _columns(quantity: str, names: tuple[str, ...]) -> str:
    data = " ".join(f"data_{quantity}{n}" for n in names)
    return data + " " + " ".join(f"pred_{quantity}{n}" for n in names)


def _save(path: Path, data: np.ndarray, header: str, append: bool) -> None:
    """One block of rows; the header only into a new or empty file (DeePMD-kit's rule)."""
    write_header = "" if append and path.exists() and path.stat().st_size > 0 else header
    try:
        with path.open("a" if append else "w", encoding="utf-8") as handle:
            np.savetxt(handle, data, header=write_header)
    except OSError as exc:
        raise MDTrainError(f"-d {path}: cannot write ({exc.strerror or exc})") from None


def write_details(
    prefix: str, result: SystemResult, system: System, name: str, append: bool
) -> None:
    """The detail rows of one tested system, called ``name`` in the headers (``append``:
    after an earlier system's)."""
    base = Path(prefix)
    n, natoms = result.nframes, result.natoms
    label, pred = result.label, result.pred

    def ref(key: str, shape: tuple[int, ...]) -> np.ndarray:
        return label[key].reshape(shape) if key in label else np.zeros(shape)

    energy = np.column_stack([ref("energy", (n,)), pred["energy"].reshape(n)])
    _save(base.with_suffix(".e.out"), energy, f"{name}: data_e pred_e", append)
    _save(base.with_suffix(".e_peratom.out"), energy / natoms, f"{name}: data_e pred_e", append)

    back = np.empty_like(system.atom_order)  # the model's atom order -> the file's
    back[system.atom_order] = np.arange(natoms)
    forces = [ref("force", (n, natoms, 3)), pred["force"].reshape(n, natoms, 3)]
    rows = np.concatenate([f[:, back].reshape(-1, 3) for f in forces], axis=1)
    _save(base.with_suffix(".f.out"), rows, f"{name}: {_columns('f', ('x', 'y', 'z'))}", append)

    virial = np.concatenate([ref("virial", (n, 9)), pred["virial"].reshape(n, 9)], axis=1)
    head = f"{name}: {_columns('v', _V)}"
    _save(base.with_suffix(".v.out"), virial, head, append)
    _save(base.with_suffix(".v_peratom.out"), virial / natoms, head, append)
    if "virial" in label and system.periodic:
        boxes = system.frames(np.arange(n), labels=())["box"]
        volume = np.abs(np.linalg.det(boxes)).reshape(n, 1)
        head = f"{name} (eV/Å³): {_columns('s', _V)}"
        _save(base.with_suffix(".s.out"), -virial / volume, head, append)


def remove_stale(prefix: str) -> None:
    """Remove the stress file of an earlier run: this run may write none (no virial labels),
    and a file left from before would read as this run's."""
    stress = Path(prefix).with_suffix(".s.out")
    if stress.is_file():
        os.remove(stress)
