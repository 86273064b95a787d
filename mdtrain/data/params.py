"""A model's frame and atomic parameters (``fparam.npy``, ``aparam.npy``) taken from a system.

The model asks for ``numb_fparam`` values per frame and ``numb_aparam`` per atom; a system
must hold them with that width (or, for frame parameters, the model has ``default_fparam``).
Problems are one line naming the system and the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from mdtrain.config.model_kind import LINEAR, model_type, network_sections
from mdtrain.errors import MDTrainError


@dataclass(frozen=True)
class ParamSpec:
    """What a model takes beside positions: counts and the default frame parameters."""

    numb_fparam: int = 0
    numb_aparam: int = 0
    default_fparam: tuple[float, ...] | None = None

    @classmethod
    def of(cls, model_config: dict) -> ParamSpec:
        """From a (normalised) ``model`` section; a ``linear_ener`` model's from its network
        parts, which all take the same parameters (DeePMD-kit passes them to every part;
        `mdtrain.config.model_kind.linear_problems` refuses parts that differ)."""
        if model_type(model_config) == LINEAR:
            specs = {cls.of(part) for _, part in network_sections(model_config)}
            specs = sorted((s for s in specs if s.any), key=repr) or [cls()]
            return specs[0]
        fit = model_config.get("fitting_net") or {}
        default = fit.get("default_fparam")
        return cls(
            int(fit.get("numb_fparam") or 0),
            int(fit.get("numb_aparam") or 0),
            None if default is None else tuple(float(v) for v in default),
        )

    @classmethod
    def of_model(cls, model) -> ParamSpec:
        """From a loaded model (eager, TorchScript or exported) through its stored config."""
        text = getattr(model, "model_config_json", None)
        return cls.of(json.loads(text)) if isinstance(text, str) and text else cls()

    @property
    def any(self) -> bool:
        return self.numb_fparam > 0 or self.numb_aparam > 0


def check_params(system, spec: ParamSpec) -> None:
    """Raise when ``system`` cannot give ``spec``'s parameters (missing file, wrong width)."""
    for name, count, per_atom in (
        ("fparam", spec.numb_fparam, False),
        ("aparam", spec.numb_aparam, True),
    ):
        if count == 0:
            continue
        if not system.has(name):
            if name == "fparam" and spec.default_fparam is not None:
                continue
            raise MDTrainError(
                f"system {system.path}: {name}.npy is missing (the model has numb_{name} = {count})"
            )
        width = system.values_per_atom(name) if per_atom else system.values_per_frame(name)
        if width != count:
            unit = "per atom" if per_atom else "per frame"
            raise MDTrainError(
                f"system {system.path}: {name}.npy has {width} values {unit} but the model has "
                f"numb_{name} = {count}"
            )


def param_problems(system, spec: ParamSpec) -> list[str]:
    """`check_params`'s problem as a list (``mdtrain check`` lists them all)."""
    try:
        check_params(system, spec)
    except MDTrainError as exc:
        return [str(exc)]
    return []


def read_params(
    system, frames: dict, nframes: int, spec: ParamSpec
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(fparam (n, numb_fparam), aparam (n, natoms, numb_aparam))`` for frames already read
    (``System.frames``), None where the model takes none."""
    if not spec.any:
        return None, None
    check_params(system, spec)
    fparam = aparam = None
    if spec.numb_fparam:
        if "fparam" in frames:
            fparam = frames["fparam"].reshape(nframes, spec.numb_fparam)
        else:
            fparam = np.tile(np.asarray(spec.default_fparam, dtype=np.float64), (nframes, 1))
    if spec.numb_aparam:
        aparam = frames["aparam"].reshape(nframes, system.natoms, spec.numb_aparam)
    return fparam, aparam
