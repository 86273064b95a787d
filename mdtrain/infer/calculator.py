"""ASE calculator for mdtrain models: checkpoints, frozen TorchScript files, or a live model.

Stress follows ASE: ``stress = -virial / volume`` in Voigt order (xx, yy, zz, yz, xz, xy).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from mdtrain.model.backend import to_device
from mdtrain.neighbors.nlist import build_nlist


class MDTrainCalculator(Calculator):
    """Energy, forces and stress of an mdtrain model for ASE ``Atoms``.

    ``model`` is a path (checkpoint or frozen TorchScript model, see ``mdtrain.infer.load``)
    or a ``torch.nn.Module`` with the EnergyModel forward signature and the attributes
    ``type_map``/``rcut``/``sel``. Chemical symbols are mapped to model types through
    ``type_map``. ``pbc`` must be all True or all False.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module,
        device: str | torch.device = "cpu",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.device = torch.device(device)
        if isinstance(model, torch.nn.Module):
            self.model = to_device(model, self.device).eval()
        else:
            self.model = load_model(model, self.device)
        self.type_map: list[str] = list(self.model.type_map)
        self.rcut = float(self.model.rcut)
        self.sel: list[int] = [int(s) for s in self.model.sel]

    def _types(self, symbols: list[str]) -> np.ndarray:
        index = {name: i for i, name in enumerate(self.type_map)}
        missing = sorted(set(symbols) - set(index))
        if missing:
            raise MDTrainError(
                f"atoms: element(s) {', '.join(missing)} not in the model type_map {self.type_map}"
            )
        return np.array([index[s] for s in symbols], dtype=np.int64)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        pbc = np.asarray(atoms.pbc, dtype=bool)
        if pbc.any() and not pbc.all():
            raise MDTrainError(f"atoms: mixed periodicity pbc={pbc.tolist()} is not supported")
        periodic = bool(pbc.all())
        coord = atoms.get_positions()
        box = np.asarray(atoms.get_cell()) if periodic else None
        if periodic and abs(np.linalg.det(box)) < 1e-10:
            raise MDTrainError("atoms: periodic cell has zero volume")
        atype = self._types(atoms.get_chemical_symbols())
        nlist, shift, _ = build_nlist(coord, box, atype, self.rcut, self.sel)

        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(a, dtype=dtype, device=self.device).unsqueeze(0)

        with torch.enable_grad():  # forces are derivatives, even for TorchScript models
            out = self.model(
                t(coord, torch.float64),
                torch.as_tensor(atype, device=self.device),
                None if box is None else t(box, torch.float64),
                t(nlist, torch.long),
                t(shift, torch.long),
            )
        energy = float(out["energy"].detach()[0])
        self.results["energy"] = energy
        self.results["free_energy"] = energy
        self.results["energies"] = out["atom_energy"].detach()[0].cpu().numpy()
        self.results["forces"] = out["force"].detach()[0].cpu().numpy()
        if periodic:
            virial = out["virial"].detach()[0].cpu().numpy()
            stress = -virial / atoms.get_volume()
            self.results["stress"] = stress.flat[[0, 4, 8, 5, 2, 1]]
        elif "stress" in properties:
            raise PropertyNotImplementedError("stress is only defined for periodic atoms")
