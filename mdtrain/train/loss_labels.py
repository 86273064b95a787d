"""What the ``loss`` section asks of the data: which terms are on, and which label files a
system must have for them. No torch here, so that ``mdtrain check`` can use it.

A term is on when both of its prefactors are non-zero (DeePMD-kit's PyTorch backend). The
energy, force and virial terms skip a system that lacks their label (its errors print as
NaN), as DeePMD-kit does; the atomic-energy (``ae``), weighted-force (``pf``) and
generalized-force (``gf``) terms need a file that only those terms use, so a system
without it is an error here rather than a term that silently trains nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# term -> the abbreviation of its prefactor keys (start_pref_<x>, limit_pref_<x>)
TERM_KEYS = {
    "energy": "e",
    "force": "f",
    "virial": "v",
    "atom_ener": "ae",
    "atom_pref": "pf",
    "drdq": "gf",
}
# terms whose label file a system must have, and what the file holds
REQUIRED_FILES = {
    "atom_ener": "atomic energies",
    "atom_pref": "per-atom force weights",
    "drdq": "dr/dq",
}


def prefactors(loss: Mapping[str, Any], term: str) -> tuple[float, float]:
    """``(start, limit)`` prefactors of ``term`` (0 when absent, or not a number: the schema
    reports that)."""
    key = TERM_KEYS[term]
    return _number(loss.get(f"start_pref_{key}")), _number(loss.get(f"limit_pref_{key}"))


def _number(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else 0.0


def term_on(loss: Mapping[str, Any], term: str) -> bool:
    start, limit = prefactors(loss, term)
    return start != 0 and limit != 0


def label_problems(
    loss: Mapping[str, Any], system: Any, outputs: Mapping[str, Any] | None = None
) -> list[str]:
    """One line per label file ``system`` lacks (or holds in the wrong shape) for the terms
    that are on; ``system`` is an opened `mdtrain.data.System`, ``outputs`` the model's
    output label files (`mdtrain.data.labels.output_labels`)."""
    if loss.get("type") == "tensor":
        return tensor_label_problems(loss, system)
    if loss.get("type") in ("dos", "property"):
        return output_label_problems(loss, system, outputs or {})
    problems = []
    for term, what in REQUIRED_FILES.items():
        if not term_on(loss, term):
            continue
        key = TERM_KEYS[term]
        if term == "atom_pref" and loss.get("use_default_pf") is True:
            continue
        if not system.has(term):
            hint = "; set loss.use_default_pf to weigh every atom by 1" if key == "pf" else ""
            problems.append(
                f"system {system.path}: {term}.npy ({what}) is missing, and the loss's {key} "
                f"term is on (start_pref_{key}, limit_pref_{key}){hint}"
            )
        elif term == "drdq":
            ncoord = int(_number(loss.get("numb_generalized_coord")))
            have = system.values_per_atom("drdq")
            if ncoord > 0 and have != 3 * ncoord:
                problems.append(
                    f"system {system.path}: drdq.npy has {have} values per atom, but "
                    f"loss.numb_generalized_coord {ncoord} needs 3 x {ncoord} = {3 * ncoord}"
                )
    return problems


def tensor_label_problems(loss: Mapping[str, Any], system: Any) -> list[str]:
    """A system of a ``tensor`` loss needs the label file of at least one term that is on
    (DeePMD-kit skips a term whose label a system lacks); which tensor is read from the
    files the system has."""
    have = [
        f"{prefix}{name}.npy"
        for name in ("dipole", "polarizability")
        for prefix, key in (("atomic_", "pref_atomic"), ("", "pref"))
        if _number(loss.get(key)) > 0 and system.has(prefix + name)
    ]
    if have:
        return []
    return [
        f"system {system.path}: no tensor label for the terms that are on (dipole.npy or "
        "atomic_dipole.npy, polarizability.npy or atomic_polarizability.npy, as loss.pref and "
        "loss.pref_atomic select)"
    ]


def output_label_problems(
    loss: Mapping[str, Any], system: Any, outputs: Mapping[str, Any]
) -> list[str]:
    """A DOS system needs ``dos.npy`` or ``atom_dos.npy`` (a term whose label a system lacks
    trains nothing on it, as in DeePMD-kit); a property system needs ``<property_name>.npy``
    (DeePMD-kit requires it)."""
    frame = [name for name, (_, atomic) in outputs.items() if not atomic]
    if not frame:
        return []
    name = frame[0]
    if loss.get("type") == "property" and not system.has(name):
        return [
            f"system {system.path}: {name}.npy is missing (the model's property_name is "
            f"{name!r}; every frame needs it)"
        ]
    if loss.get("type") == "dos" and not (system.has(name) or system.has(f"atom_{name}")):
        return [f"system {system.path}: neither {name}.npy nor atom_{name}.npy (a DOS label)"]
    return []


def one_sided_terms(loss: Mapping[str, Any]) -> list[str]:
    """One warning per term of the ``loss`` section that has exactly one non-zero prefactor:
    it trains nothing here (and in DeePMD-kit's PyTorch backend), though DeePMD-kit's
    TensorFlow backend would train it, so an input from there may expect it."""
    out = []
    for term, key in TERM_KEYS.items():
        start, limit = prefactors(loss, term)
        if (start != 0) != (limit != 0):
            name = {"atom_ener": "atomic energy", "atom_pref": "pf", "drdq": "gf"}.get(term, term)
            out.append(
                f"loss: start_pref_{key} is {start:g} and limit_pref_{key} {limit:g}, so the "
                f"{name} term is off (a term trains only when both prefactors are non-zero, "
                "as in DeePMD-kit's PyTorch backend)"
            )
    return out
