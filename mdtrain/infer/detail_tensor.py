"""``mdtrain test -d PREFIX`` of a dipole or polar model: DeePMD-kit 3.2's detail file of
those models (``deepmd/infer/model_test/tensor.py``, ``dp test -d``, with ``-a`` for the
atomic layout).

One file per tested system: ``PREFIX`` with its last suffix replaced by ``.out`` for the
first system, ``.out.k`` for the ``k``-th (k > 0). One row per frame, written by
``numpy.savetxt`` (``%.18e``, one space) under a header without the system's name:

- frame layout (default): the labelled frame tensor, then the predicted one (``dipole.npy``,
  3 values; ``polarizability.npy``, 9 row-major), header ``data_x data_y data_z pred_x
  pred_y pred_z`` (``data_pxx ... data_pzz pred_pxx ... pred_pzz`` for a polarizability);
- atomic layout (``-a``): the labelled atomic tensors of the atoms of ``sel_type``, in the
  system's file order, then the predicted ones, header ``data_x1 data_y1 data_z1 data_x2 ...
  pred_x1 ...`` numbered over those atoms; a system without such atoms gets no file, as in
  DeePMD-kit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mdtrain.data import System
from mdtrain.errors import MDTrainError
from mdtrain.infer.test import SystemResult

COMPONENTS = {
    "dipole": ("x", "y", "z"),
    "polarizability": ("pxx", "pxy", "pxz", "pyx", "pyy", "pyz", "pzx", "pzy", "pzz"),
}


def tensor_detail_path(prefix: str, group: int) -> Path:
    """The detail file of the ``group``-th tested system."""
    return Path(prefix).with_suffix(".out" + (f".{group}" if group else ""))


def needed_label(kind: str, atomic: bool) -> str:
    """The label file (without ``.npy``) the layout compares with."""
    return f"atomic_{kind}" if atomic else kind


def check_detail_labels(systems: list[System], names: list[str], kind: str, atomic: bool) -> None:
    """Every system must hold the layout's label, as ``dp test`` requires (before any work)."""
    label = needed_label(kind, atomic)
    option = "-d -a" if atomic else "-d"
    for system, name in zip(systems, names, strict=True):
        if not system.has(label):
            raise MDTrainError(
                f"system {name}: {option} of a {kind} model compares with {label}.npy, which "
                "the system does not have"
            )


def header(kind: str, atomic: bool, nsel: int) -> str:
    """DeePMD-kit's header of the layout (``nsel`` atoms of ``sel_type``)."""
    names = COMPONENTS[kind]
    if not atomic:
        return " ".join([f"data_{n}" for n in names] + [f"pred_{n}" for n in names])
    return " ".join(
        f"{prefix}_{n}{i}" for prefix in ("data", "pred") for i in range(1, nsel + 1) for n in names
    )


def write_tensor_details(
    prefix: str,
    result: SystemResult,
    system: System,
    kind: str,
    atomic: bool,
    keep: np.ndarray,
    group: int,
) -> None:
    """The detail file of the ``group``-th tested system. ``keep``: which of the system's
    atoms (model order) carry a tensor; the result's atomic arrays hold those atoms only, in
    model order."""
    n = result.nframes
    if atomic:
        key = f"atomic_{kind}"
        sel = np.flatnonzero(keep)
        if sel.size == 0:
            return  # DeePMD-kit: no atom of sel_type, no details
        order = np.argsort(system.atom_order[sel], kind="stable")  # -> the file's order
        ref = result.label[key].reshape(n, sel.size, -1)[:, order].reshape(n, -1)
        pred = result.pred[key].reshape(n, sel.size, -1)[:, order].reshape(n, -1)
    else:
        ref, pred = result.label[kind].reshape(n, -1), result.pred[kind].reshape(n, -1)
    path = tensor_detail_path(prefix, group)
    try:
        with path.open("w", encoding="utf-8") as handle:
            np.savetxt(handle, np.concatenate([ref, pred], axis=1), header=header(
                kind, atomic, int(keep.sum())
            ))  # fmt: skip
    except OSError as exc:
        raise MDTrainError(f"-d {path}: cannot write ({exc.strerror or exc})") from None
