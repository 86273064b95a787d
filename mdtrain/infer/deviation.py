"""Model deviation of a committee: how much the models' forces, virials and energies disagree.

The definitions are DeePMD-kit 3.2's (``dp model-devi``, the LAMMPS ``model_devi.out``), so
dpgen-style selection reads our numbers as it reads DeePMD's. For models ``k = 1..m``
(averages ``<.>`` over the models, standard deviations with divisor ``m``):

- force, per atom ``i``: ``ε_F,i = sqrt(<|F_i,k - <F_i>|²>)``, the norm over x, y, z of the
  per-component standard deviations; ``max``/``min``/``avg`` over the atoms of a frame.
- virial, per component ``αβ`` of the virial divided by the atom count:
  ``ε_V,αβ = std_k(W_αβ,k / N)``; ``max``/``min`` over the 9 components and ``avg`` their
  root mean square (``|ε_V| / 3``, DeePMD's ``norm / 3``).
- energy: ``std_k(E_k / N)``, the total energy per atom (atom energies are not a fitted
  quantity).
- relative (``--relative LEVEL``): ``ε_F,i / (|<F_i>| + LEVEL)``; ``--relative-v LEVEL``:
  ``ε_V,αβ / (|<W / N>| + LEVEL)`` with ``|.|`` the norm of the frame's 9 mean components
  (DeePMD-kit 3.2.0's own Python fails to broadcast this unless a set holds one frame; this
  is the definition its documentation gives).

Arrays are float64 numpy: models first, then frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def force_deviation(forces: np.ndarray, relative: float | None = None) -> np.ndarray:
    """Per-atom force deviation ``(nframes, natoms)`` of ``forces`` ``(nmodels, nframes,
    natoms, 3)``; divided by ``|<F_i>| + relative`` when ``relative`` is given."""
    forces = np.asarray(forces, dtype=np.float64)
    devi = np.linalg.norm(forces.std(axis=0), axis=-1)
    if relative is not None:
        devi = devi / (np.linalg.norm(forces.mean(axis=0), axis=-1) + relative)
    return devi


def virial_deviation(virials_per_atom: np.ndarray, relative: float | None = None) -> np.ndarray:
    """Per-component virial deviation ``(nframes, 9)`` of ``virials_per_atom`` ``(nmodels,
    nframes, 9)`` (virials already divided by the atom count); divided by the norm of the
    frame's mean virial plus ``relative`` when that is given."""
    virials = np.asarray(virials_per_atom, dtype=np.float64)
    devi = virials.std(axis=0)
    if relative is not None:
        devi = devi / (np.linalg.norm(virials.mean(axis=0), axis=-1, keepdims=True) + relative)
    return devi


def energy_deviation(energies_per_atom: np.ndarray) -> np.ndarray:
    """Energy deviation ``(nframes,)`` of ``energies_per_atom`` ``(nmodels, nframes)``."""
    return np.asarray(energies_per_atom, dtype=np.float64).std(axis=0)


@dataclass
class Deviation:
    """The deviations of some frames: the columns of ``model_devi.out`` and the per-atom force
    deviations (``--atomic``), in the atoms' order as given."""

    virial: np.ndarray  # (nframes, 3): max, min, avg
    force: np.ndarray  # (nframes, 3): max, min, avg
    energy: np.ndarray  # (nframes,)
    atomic_force: np.ndarray  # (nframes, natoms)

    def columns(self, atomic: bool = False) -> np.ndarray:
        """``max_devi_v min_devi_v avg_devi_v max_devi_f min_devi_f avg_devi_f devi_e``
        (then the atoms' force deviations with ``atomic``), one row per frame."""
        parts = [self.virial, self.force, self.energy[:, None]]
        if atomic:
            parts.append(self.atomic_force)
        return np.concatenate(parts, axis=1)


def committee_deviation(
    energy: np.ndarray,
    force: np.ndarray,
    virial: np.ndarray,
    relative: float | None = None,
    relative_v: float | None = None,
) -> Deviation:
    """All deviations of a committee's predictions: ``energy`` ``(nmodels, nframes)``,
    ``force`` ``(nmodels, nframes, natoms, 3)``, ``virial`` ``(nmodels, nframes, 3, 3)``
    (totals, not divided by the atom count)."""
    natoms = force.shape[2]
    nmodels, nframes = energy.shape
    per_atom_virial = np.asarray(virial, dtype=np.float64).reshape(nmodels, nframes, 9) / natoms
    dv = virial_deviation(per_atom_virial, relative_v)
    df = force_deviation(force, relative)
    return Deviation(
        virial=np.stack([dv.max(-1), dv.min(-1), np.linalg.norm(dv, axis=-1) / 3], axis=1),
        force=np.stack([df.max(-1), df.min(-1), df.mean(-1)], axis=1),
        energy=energy_deviation(np.asarray(energy, dtype=np.float64) / natoms),
        atomic_force=df,
    )


# ------------------------------------------------------------------------------ the file

#: Column names of ``model_devi.out`` after ``step``.
COLUMNS = (
    "max_devi_v",
    "min_devi_v",
    "avg_devi_v",
    "max_devi_f",
    "min_devi_f",
    "avg_devi_f",
    "devi_e",
)


def model_devi_header(title: str, atomic: bool = False) -> str:
    """The two comment lines DeePMD-kit 3.2 writes before a system's rows: ``# TITLE`` and
    the column names (``step`` 10 wide, the others 19 wide, padding kept)."""
    names = "step".ljust(10) + "".join(name.ljust(19) for name in COLUMNS)
    if atomic:
        names += "atm_devi_f(N)".ljust(19)
    return f"# {title}\n# {names}\n"


def model_devi_rows(steps: np.ndarray, columns: np.ndarray) -> str:
    """Rows as DeePMD-kit writes them: the step as ``%12d``, each value as ``%19.6e``."""
    lines = []
    for step, row in zip(np.asarray(steps, dtype=np.int64), columns, strict=True):
        lines.append(f"{step:12d}" + "".join(f"{v:19.6e}" for v in row) + "\n")
    return "".join(lines)
