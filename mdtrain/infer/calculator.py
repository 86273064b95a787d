"""ASE calculators for mdtrain models (checkpoints, frozen TorchScript files, DeePMD-kit
``.dp`` files, or live modules): one model (``MDTrainCalculator``) or a committee, with the
models' mean and their deviation (``CommitteeCalculator``).

Stress follows ASE: ``stress = -virial / volume`` in Voigt order (xx, yy, zz, yz, xz, xy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from mdtrain.data.params import ParamSpec
from mdtrain.errors import MDTrainError
from mdtrain.infer.committee import check_committee, committee_members
from mdtrain.infer.deviation import committee_deviation
from mdtrain.infer.finite import check_predictions, check_weights
from mdtrain.infer.load import load_model
from mdtrain.infer.model_devi import neighbor_groups
from mdtrain.model.backend import to_device
from mdtrain.neighbors.layout import PER_TYPE, ListLayout, layout_of


class MDTrainCalculator(Calculator):
    """Energy, forces and stress of an mdtrain model for ASE ``Atoms``; for a dipole or
    polar model instead its tensor: ``dipole`` (3,) (``atoms.get_dipole_moment()``) and
    ``atom_dipole`` (natoms, 3), or ``polarizability`` and ``atom_polarizability`` (3 x 3
    each), atoms in the ``Atoms``' order (``calc.get_property("polarizability", atoms)``);
    for a DOS or property model its output: ``dos`` (numb_dos,) and ``atom_dos`` (natoms,
    numb_dos), or ``<property_name>`` (task_dim,) and ``atom_<property_name>``.

    ``model`` is a path (checkpoint or frozen TorchScript model, see ``mdtrain.infer.load``)
    or a ``torch.nn.Module`` with the EnergyModel forward signature and the attributes
    ``type_map``/``rcut``/``sel``. Chemical symbols are mapped to model types through
    ``type_map``. ``pbc`` must be all True or all False. A model with frame parameters takes
    them from ``atoms.info["fparam"]`` (numb_fparam values; its ``default_fparam`` when
    absent), one with atomic parameters from ``atoms.arrays["aparam"]`` (natoms x numb_aparam).
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
            self.model_name = "the calculator's model"
        else:
            self.model = load_model(model, self.device)
            self.model_name = f"model {model}"
        check_weights(self.model, self.model_name)
        self.type_map: list[str] = list(self.model.type_map)
        self.rcut = float(self.model.rcut)
        self.sel: list[int] = [int(s) for s in self.model.sel]
        self.params = ParamSpec.of_model(self.model)
        # a dipole/polar model's tensor, or a DOS/property model's output ("dos", its name)
        self.tensor: str | None = getattr(self.model, "label", None)
        self.tensor = self.tensor or getattr(self.model, "output", None)
        if self.tensor:  # its tensor, whole and per atom (in the atoms' order)
            self.implemented_properties = [self.tensor, f"atom_{self.tensor}"]

    def calculate(self, atoms=None, properties=None, system_changes=all_changes) -> None:
        properties = properties or (self.tensor or "energy",)
        super().calculate(atoms, properties, system_changes)
        frame = atoms_frame(self.atoms, self.type_map, self.params)
        out = evaluate_frame(self.model, frame, self.device)
        check_predictions(
            {k: v[None] for k, v in out.items()}, self.model_name, "the calculator's atoms"
        )
        if self.tensor:
            shape = {"dipole": (3,), "polarizability": (3, 3)}.get(self.tensor, (-1,))
            atomic = out[f"atom_{self.tensor}"]
            self.results[self.tensor] = out[self.tensor].reshape(shape)
            self.results[f"atom_{self.tensor}"] = atomic.reshape(len(atomic), *shape)
            return
        self.results.update(frame.results(out, properties))


@dataclass
class AtomsFrame:
    """One ``Atoms`` as model inputs (numpy): positions, cell (None: non-periodic), types."""

    coord: np.ndarray
    box: np.ndarray | None
    atype: np.ndarray
    volume: float | None
    fparam: np.ndarray | None = None  # (numb_fparam,) for a model that takes them
    aparam: np.ndarray | None = None  # (natoms, numb_aparam)

    def nlist(
        self, rcut: float, sel: list[int], layout: ListLayout = PER_TYPE
    ) -> tuple[np.ndarray, np.ndarray]:
        nlist, shift, _ = layout.build(self.coord, self.box, self.atype, rcut, sel)
        return nlist, shift

    def results(self, out: dict[str, np.ndarray], properties=()) -> dict[str, Any]:
        """ASE's results from one frame's ``energy``/``atom_energy``/``force``/``virial``;
        stress ``-virial / volume`` in Voigt order where the frame is periodic."""
        energy = float(out["energy"])
        results: dict[str, Any] = {
            "energy": energy,
            "free_energy": energy,
            "energies": out["atom_energy"],
            "forces": out["force"],
        }
        if self.volume is not None:
            results["stress"] = (-out["virial"] / self.volume).flat[[0, 4, 8, 5, 2, 1]]
        elif "stress" in properties:
            raise PropertyNotImplementedError("stress is only defined for periodic atoms")
        return results


def atoms_frame(atoms, type_map: list[str], params: ParamSpec | None = None) -> AtomsFrame:
    """Positions, cell and model types of ``atoms`` (and the parameters ``params`` asks for);
    one-line errors for elements outside ``type_map``, mixed periodicity, a periodic cell
    without volume and missing or misshapen parameters."""
    pbc = np.asarray(atoms.pbc, dtype=bool)
    if pbc.any() and not pbc.all():
        raise MDTrainError(f"atoms: mixed periodicity pbc={pbc.tolist()} is not supported")
    periodic = bool(pbc.all())
    box = np.asarray(atoms.get_cell()) if periodic else None
    if periodic and abs(np.linalg.det(box)) < 1e-10:
        raise MDTrainError("atoms: periodic cell has zero volume")
    symbols = atoms.get_chemical_symbols()
    index = {name: i for i, name in enumerate(type_map)}
    missing = sorted(set(symbols) - set(index))
    if missing:
        raise MDTrainError(
            f"atoms: element(s) {', '.join(missing)} not in the model type_map {type_map}"
        )
    return AtomsFrame(
        coord=atoms.get_positions(),
        box=box,
        atype=np.array([index[s] for s in symbols], dtype=np.int64),
        volume=atoms.get_volume() if periodic else None,
        **atoms_params(atoms, params or ParamSpec()),
    )


def atoms_params(atoms, params: ParamSpec) -> dict[str, np.ndarray | None]:
    """``fparam`` from ``atoms.info`` and ``aparam`` from ``atoms.arrays``, checked."""
    out: dict[str, np.ndarray | None] = {"fparam": None, "aparam": None}
    if params.numb_fparam:
        value = atoms.info.get("fparam")
        if value is None and params.default_fparam is None:
            raise MDTrainError(
                f'atoms: the model needs {params.numb_fparam} frame parameters in atoms.info["fparam"]'
            )
        if value is not None:
            out["fparam"] = np.asarray(value, dtype=np.float64).reshape(-1)
            if out["fparam"].size != params.numb_fparam:
                raise MDTrainError(
                    f'atoms.info["fparam"]: {out["fparam"].size} values, the model has '
                    f"numb_fparam = {params.numb_fparam}"
                )
    if params.numb_aparam:
        value = atoms.arrays.get("aparam")
        if value is None:
            raise MDTrainError(
                f"atoms: the model needs {params.numb_aparam} atomic parameter(s) per atom in "
                'atoms.arrays["aparam"]'
            )
        aparam = np.asarray(value, dtype=np.float64)
        if aparam.size != len(atoms) * params.numb_aparam:
            raise MDTrainError(
                f'atoms.arrays["aparam"]: shape {list(aparam.shape)}, expected '
                f"[{len(atoms)}, {params.numb_aparam}]"
            )
        out["aparam"] = aparam.reshape(len(atoms), params.numb_aparam)
    return out


def evaluate_frame(
    model: torch.nn.Module,
    frame: AtomsFrame,
    device: torch.device,
    lists: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The model's outputs for one frame (an energy model: ``energy`` (scalar array),
    ``atom_energy``, ``force`` and ``virial``; a tensor model: its tensor and atomic ones);
    ``lists`` (nlist, shift) when already built for the model's rcut and sel."""
    nlist, shift = lists or frame.nlist(
        float(model.rcut), [int(s) for s in model.sel], layout_of(model)
    )

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(a, dtype=dtype, device=device).unsqueeze(0)

    inputs = [
        t(frame.coord, torch.float64),
        torch.as_tensor(frame.atype, device=device),
        None if frame.box is None else t(frame.box, torch.float64),
        t(nlist, torch.long),
        t(shift, torch.long),
    ]
    if frame.fparam is not None or frame.aparam is not None:
        for value in (frame.fparam, frame.aparam):
            inputs.append(None if value is None else t(value, torch.float64))
    with torch.enable_grad():  # forces are derivatives, even for TorchScript models
        out = model(*inputs)
    return {k: v.detach()[0].cpu().numpy() for k, v in out.items()}


ModelLike = str | os.PathLike | torch.nn.Module


class CommitteeCalculator(Calculator):
    """The mean energy, forces and stress of a committee of models, and how much the models
    disagree, for ASE ``Atoms``; an MD loop can stop when the disagreement grows.

    ``models`` is a committee folder (``member-*/model.ckpt.pt``, as ``mdtrain train
    --ensemble`` writes), or a list of model files, folders and live modules (see
    `mdtrain.infer.committee`); at least two models with one ``type_map``. Models sharing
    ``rcut`` and ``sel`` share each frame's neighbour list.

    Besides ASE's properties (the means over the models), ``results`` holds the deviations
    as ``mdtrain model-devi`` defines them (`mdtrain.infer.deviation`, DeePMD-kit's):
    ``force_deviation`` (per atom, eV/Å), ``max_force_deviation`` / ``min_...`` /
    ``avg_...``, ``energy_deviation`` (eV/atom), ``max_virial_deviation`` / ``min_...`` /
    ``avg_...`` (eV/atom), and every model's ``committee_energy`` (nmodels,) and
    ``committee_forces`` (nmodels, natoms, 3). ``relative``/``relative_v`` make the force
    and virial deviations relative, as ``--relative``/``--relative-v`` do.
    """

    DEVIATIONS = [
        "force_deviation",
        "max_force_deviation",
        "min_force_deviation",
        "avg_force_deviation",
        "energy_deviation",
        "max_virial_deviation",
        "min_virial_deviation",
        "avg_virial_deviation",
        "committee_energy",
        "committee_forces",
    ]
    implemented_properties = MDTrainCalculator.implemented_properties + DEVIATIONS

    def __init__(
        self,
        models: ModelLike | list[ModelLike],
        device: str | torch.device = "cpu",
        relative: float | None = None,
        relative_v: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.device = torch.device(device)
        self.models, self.names = _load_members(models, self.device)
        self.type_map: list[str] = list(self.models[0].type_map)
        self.relative, self.relative_v = relative, relative_v
        self.params = ParamSpec.of_model(self.models[0])

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        frame = atoms_frame(self.atoms, self.type_map, self.params)
        outs: list[dict[str, np.ndarray]] = [{}] * len(self.models)
        for rcut, sel, layout, members in neighbor_groups(self.models):
            lists = frame.nlist(rcut, sel, layout)  # once for the models with these lists
            for k in members:
                outs[k] = evaluate_frame(self.models[k], frame, self.device, lists)
                where = "the calculator's atoms"
                check_predictions(
                    {key: v[None] for key, v in outs[k].items()}, self.names[k], where
                )
        stacked = {key: np.stack([out[key] for out in outs]) for key in outs[0]}
        mean = {key: value.mean(axis=0) for key, value in stacked.items()}
        self.results.update(frame.results(mean, properties))
        devi = committee_deviation(
            stacked["energy"][:, None],
            stacked["force"][:, None],
            stacked["virial"][:, None],
            self.relative,
            self.relative_v,
        )
        self.results.update(
            force_deviation=devi.atomic_force[0],
            max_force_deviation=float(devi.force[0, 0]),
            min_force_deviation=float(devi.force[0, 1]),
            avg_force_deviation=float(devi.force[0, 2]),
            energy_deviation=float(devi.energy[0]),
            max_virial_deviation=float(devi.virial[0, 0]),
            min_virial_deviation=float(devi.virial[0, 1]),
            avg_virial_deviation=float(devi.virial[0, 2]),
            committee_energy=stacked["energy"],
            committee_forces=stacked["force"],
        )


def _load_members(
    models: ModelLike | list[ModelLike], device: torch.device
) -> tuple[list, list[str]]:
    """The committee's modules on ``device``, in eval mode (see `CommitteeCalculator`), and
    their names for messages."""
    items = list(models) if isinstance(models, (list, tuple)) else [models]
    loaded, names = [], []
    for item in items:
        if isinstance(item, torch.nn.Module):
            loaded.append(to_device(item, device).eval())
            names.append(f"model {len(names)}")
            check_weights(loaded[-1], names[-1])
            continue
        for file in committee_members(item):
            loaded.append(load_model(file, device))
            names.append(file)
    check_committee(loaded, names)
    return loaded, [n if n.startswith("model ") else f"model {n}" for n in names]
