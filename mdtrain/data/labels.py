"""The arrays a system may hold and their widths (``LAYOUT``), and the label files of a
model's own outputs beyond those: a DOS model's ``dos.npy`` / ``atom_dos.npy`` (``numb_dos``
values per frame / per atom) and a property model's ``<property_name>.npy`` / ``atom_<property_name>.npy`` (``task_dim``), as
DeePMD-kit 3.2 names them. A `System` opened with them checks their widths (one line naming
the file) and reads them like any label. No torch here (``mdtrain check`` uses it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mdtrain.errors import MDTrainError

LABELS = ("energy", "force", "virial")
# per-atom labels of the loss options (DeePMD-kit's names): read when a system has them
EXTRA_LABELS = ("atom_ener", "atom_pref", "atom_ener_coeff", "drdq")
# labels of the tensor models (DeePMD-kit's files): global per frame, atomic per atom
TENSOR_LABELS = ("dipole", "polarizability", "atomic_dipole", "atomic_polarizability")
# the atomic ones, which may hold only the atoms of the model's sel_type (`OutputLabels`)
ATOMIC_TENSORS = ("atomic_dipole", "atomic_polarizability")
# model inputs beside positions (DeePMD-kit's frame and atomic parameters): read when present
PARAMS = ("fparam", "aparam")
# values per frame, as a multiple of natoms (True) or a fixed count (False)
LAYOUT = {
    "coord": (3, True),
    "box": (9, False),
    "energy": (1, False),
    "force": (3, True),
    "virial": (9, False),
    "atom_ener": (1, True),
    "atom_pref": (1, True),
    "atom_ener_coeff": (1, True),
    "drdq": (0, True),  # 3 x numb_generalized_coord per atom: any multiple of 3 here
    "dipole": (3, False),
    "polarizability": (9, False),
    "atomic_dipole": (3, True),
    "atomic_polarizability": (9, True),
    "fparam": (0, False),  # numb_fparam per frame, checked against the model elsewhere
    "aparam": (0, True),  # numb_aparam per atom
}
# arrays whose width the system learns from the first set: name -> (values per unit, unit)
FREE_WIDTH = {
    "drdq": (3, "x 3 x numb_generalized_coord"),
    "fparam": (1, "numb_fparam"),
    "aparam": (1, "x numb_aparam"),
}
# names a property file may not take: the arrays a system already reads under them
_TAKEN = frozenset({*LAYOUT, "type", "real_atom_types", "dos", "atom_dos"})
DOS_DEFAULT = 300  # numb_dos when the input leaves it out (DeePMD-kit's)


class OutputLabels(dict):
    """`output_labels`' answer: ``{file name: (values, per atom)}``, and ``sel_type``: for a
    dipole or polar model whose ``sel_type`` leaves out some types, those it keeps (the
    model's type indices). An atomic tensor file (``atomic_dipole.npy``) may then hold the
    atoms of these types only, in the file's atom order, as in DeePMD-kit's DPLR example."""

    sel_type: tuple[int, ...] | None = None


def output_labels(model_config: Any) -> OutputLabels:
    """``{file name: (values, per atom)}`` of the model section's outputs; empty for the
    models whose labels every system reads anyway (a tensor model's ``sel_type`` aside)."""
    fit = model_config.get("fitting_net") if isinstance(model_config, dict) else None
    if not isinstance(fit, dict):
        return OutputLabels()
    kind = fit.get("type")
    if kind in ("dipole", "polar"):
        out = OutputLabels()
        out.sel_type = _sel_type(model_config, fit)
        return out
    if kind == "dos":
        width = _count(fit.get("numb_dos", DOS_DEFAULT), "numb_dos")
        return OutputLabels(dos=(width, False), atom_dos=(width, True))
    if kind == "property":
        name = property_name(fit)
        width = _count(fit.get("task_dim", 1), "task_dim")
        return OutputLabels({name: (width, False), f"atom_{name}": (width, True)})
    return OutputLabels()


def _sel_type(model: dict, fit: dict) -> tuple[int, ...] | None:
    """The types whose atoms carry a tensor: the fitting's ``sel_type`` (or its aliases; all
    types when absent or empty) less ``atom_exclude_types``, as DeePMD-kit's
    ``get_sel_type``; None when that is every type or the section is malformed (the model
    checks say why)."""
    type_map = model.get("type_map")
    if not isinstance(type_map, list):
        return None
    sel = next((fit[k] for k in ("sel_type", "dipole_type", "pol_type") if k in fit), None)
    sel = [sel] if isinstance(sel, int) else sel or list(range(len(type_map)))
    off = model.get("atom_exclude_types") or []
    if not isinstance(sel, list) or not isinstance(off, list):
        return None
    kept = set(sel) - set(off)
    if not all(type(t) is int for t in [*sel, *off]) or kept >= set(range(len(type_map))):
        return None
    return tuple(sorted(kept))


def scatter_selected(data: np.ndarray, selected: np.ndarray, k: int) -> np.ndarray:
    """Rows (n, nsel * k) of the atoms ``selected`` (a mask over all atoms, file order) as
    rows (n, natoms * k), zero for the other atoms, as DeePMD-kit fills them."""
    n, natoms = len(data), len(selected)
    full = np.zeros((n, natoms, k), data.dtype)
    full[:, selected] = data.reshape(n, int(selected.sum()), k)
    return full.reshape(n, -1)


def property_name(fit: dict) -> str:
    """``property_name`` of a property fitting, checked to name a file of its own."""
    name = fit.get("property_name")
    where = "model/fitting_net/property_name"
    if not isinstance(name, str) or not name:
        raise MDTrainError(f"{where}: required (the name of the label file, without .npy)")
    if name in _TAKEN or name.startswith("atom_") or "/" in name or "." in name:
        raise MDTrainError(
            f"{where}: {name!r} names a file mdtrain reads as something else; choose another"
        )
    return name


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MDTrainError(f"model/fitting_net/{key}: {value!r} must be a positive integer")
    return int(value)
