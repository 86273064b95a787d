"""Exported programs (``.pt2``, written by ``mdtrain freeze -o model.pt2``), read as modules
with the eager model's forward.

The file is ``torch.export.save``'s archive of one program, loadable without mdtrain
(``torch.export.load(path).module()``). Its inputs are those of the EnergyModel, except
that the cell is always a tensor: ``coord`` (nf, N, 3) float64, ``atype`` (N,) int64,
``box`` (nf, 3, 3) float64 (zeros for non-periodic frames, whose ``shift`` is zero),
``nlist`` (nf, N, nnei) int64 and ``shift`` (nf, N, nnei, 3) int64 as
``mdtrain.neighbors.nlist.build_nlist`` makes them (a type-mixed model's one list,
``mixed_types`` in the metadata); nf and N are free. An energy model's program returns the
dict ``energy``, ``atom_energy``, ``force``, ``virial``: the derivatives are operations of
the program's graph (traced from autograd), so it runs without autograd, under ``no_grad``
too. A dipole or polar model's returns ``<label>`` and ``atom_<label>``, a DOS or property
model's ``<name>`` and ``atom_<name>``, as their eager forwards. Beside it,
``extra/mdtrain.json`` holds the metadata a frozen ``.pth`` file holds, and for the models
without forces what `mdtrain test` and the calculator ask of them (``outputs``).
"""

from __future__ import annotations

import json
import os
import zipfile

import torch
import torch.export.passes
from torch import Tensor, nn

from mdtrain.data.params import ParamSpec
from mdtrain.errors import MDTrainError

#: Name of the JSON metadata stored beside the program (as in a frozen file).
PROGRAM_METADATA = "mdtrain.json"


def is_exported_program(path: str | os.PathLike) -> bool:
    """True when ``path`` is a ``torch.export`` archive (``.pt2``), whatever it is called."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith("/archive_format")]
            return bool(names) and zf.read(names[0]).strip() == b"pt2"
    except (zipfile.BadZipFile, OSError, KeyError):
        return False


class ExportedModel(nn.Module):
    """An exported program behind the eager model's forward (``box`` may be None) and its
    attributes ``type_map``, ``rcut``, ``sel`` and ``mixed_types`` (and a model without
    forces' ``kind``, ``label`` or ``output``, ``atom_keep``); ``metadata`` is what freeze
    stored."""

    def __init__(
        self, program: nn.Module, metadata: dict, device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        self.program = program
        self.metadata = metadata
        self.type_map = [str(t) for t in metadata["type_map"]]
        self.rcut = float(metadata["rcut"])
        self.sel = [int(s) for s in metadata["sel"]]
        self.mixed_types = bool(metadata.get("mixed_types", False))  # the list's layout
        self.backend = "exported"
        config = metadata.get("model_config")
        self.model_config_json = json.dumps(config) if isinstance(config, dict) else ""
        self.params = ParamSpec.of(config) if isinstance(config, dict) else ParamSpec()
        # a model without forces: its kind and output names (infer/freeze.output_attributes)
        outputs = metadata.get("outputs") or {}
        if outputs:
            keep = torch.tensor(outputs["atom_keep"], dtype=torch.float64, device=device)
            self.register_buffer("atom_keep", keep)
            for name in ("kind", "label", "tensor_size", "output"):
                if name in outputs:
                    setattr(self, name, outputs[name])

    def train(self, mode: bool = True) -> ExportedModel:
        """Only records the mode: an exported program has none (it refuses ``eval()``)."""
        self.training = mode
        return self

    def forward(
        self,
        coord: Tensor,
        atype: Tensor,
        box: Tensor | None,
        nlist: Tensor,
        shift: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The EnergyModel forward; ``fparam``/``aparam`` for a model with frame/atomic
        parameters (``default_fparam`` when ``fparam`` is not given and it has one)."""
        coord = coord.to(torch.float64)
        nf, natoms = coord.shape[0], coord.shape[1]
        box = coord.new_zeros(nf, 3, 3) if box is None else box.to(torch.float64)
        params = []
        if self.params.numb_fparam:
            if fparam is None and self.params.default_fparam is not None:
                fparam = coord.new_tensor(self.params.default_fparam).expand(nf, -1)
            if fparam is None:
                raise MDTrainError("this model needs frame parameters (fparam)")
            params.append(fparam.to(torch.float64).reshape(nf, self.params.numb_fparam))
        if self.params.numb_aparam:
            if aparam is None:
                raise MDTrainError("this model needs atomic parameters (aparam)")
            shape = (nf, natoms, self.params.numb_aparam)
            params.append(aparam.to(torch.float64).reshape(shape))
        with torch.no_grad():  # the program holds its own derivatives
            out = self.program(coord, atype, box, nlist, shift, *params)
        return dict(out)


def load_program(path: str, device: str | torch.device = "cpu") -> ExportedModel:
    """The program in ``path`` on ``device`` (its graph's device constants moved there too);
    the metadata is read first, since rebuilding the graph takes seconds."""
    metadata = read_program_metadata(path)
    try:
        program = torch.export.load(path)
        if torch.device(device).type != "cpu":
            program = torch.export.passes.move_to_device_pass(program, torch.device(device))
        module = program.module()
    except Exception as exc:  # corrupt archives raise several kinds
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise MDTrainError(f"model {path}: cannot load the exported program ({first})") from None
    return ExportedModel(module, metadata, device)


def read_program_metadata(path: str | os.PathLike) -> dict:
    """The metadata ``mdtrain freeze`` stored beside the program (``extra/mdtrain.json``)."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith(f"/extra/{PROGRAM_METADATA}")]
            metadata = json.loads(zf.read(names[0])) if names else None
    except (zipfile.BadZipFile, OSError, ValueError, UnicodeDecodeError):
        metadata = None
    if not isinstance(metadata, dict) or not {"type_map", "rcut", "sel"} <= metadata.keys():
        raise MDTrainError(
            f"model {path}: an exported program without mdtrain's {PROGRAM_METADATA} "
            "(type_map, rcut, sel); not written by mdtrain freeze"
        )
    return metadata
