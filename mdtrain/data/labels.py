"""The label files of a model's own outputs beyond the fixed ones (energy, forces, tensors):
a DOS model's ``dos.npy`` / ``atom_dos.npy`` (``numb_dos`` values per frame / per atom) and a
property model's ``<property_name>.npy`` / ``atom_<property_name>.npy`` (``task_dim``), as
DeePMD-kit 3.2 names them. A `System` opened with them checks their widths (one line naming
the file) and reads them like any label. No torch here (``mdtrain check`` uses it).
"""

from __future__ import annotations

from typing import Any

from mdtrain.errors import MDTrainError

# names a property file may not take: the arrays a system already reads under them
_TAKEN = frozenset(
    {
        "coord",
        "box",
        "type",
        "real_atom_types",
        "energy",
        "force",
        "virial",
        "atom_ener",
        "atom_pref",
        "atom_ener_coeff",
        "drdq",
        "dipole",
        "polarizability",
        "atomic_dipole",
        "atomic_polarizability",
        "fparam",
        "aparam",
        "dos",
        "atom_dos",
    }
)
DOS_DEFAULT = 300  # numb_dos when the input leaves it out (DeePMD-kit's)


def output_labels(model_config: Any) -> dict[str, tuple[int, bool]]:
    """``{file name: (values, per atom)}`` of the model section's outputs; empty for the
    models whose labels every system reads anyway."""
    fit = model_config.get("fitting_net") if isinstance(model_config, dict) else None
    if not isinstance(fit, dict):
        return {}
    kind = fit.get("type")
    if kind == "dos":
        width = _count(fit.get("numb_dos", DOS_DEFAULT), "numb_dos")
        return {"dos": (width, False), "atom_dos": (width, True)}
    if kind == "property":
        name = property_name(fit)
        width = _count(fit.get("task_dim", 1), "task_dim")
        return {name: (width, False), f"atom_{name}": (width, True)}
    return {}


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
