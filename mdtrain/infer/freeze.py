"""Freezing: a model → a file usable without mdtrain (for ``mdtrain freeze``), either
TorchScript (``freeze_model``, ``.pth``) or a ``torch.export`` program (``export_model``,
``.pt2``, read back by `mdtrain.infer.program`).

A frozen ``.pth`` file holds the scripted EnergyModel (same forward, attributes ``type_map``,
``rcut``, ``sel``) and, in its ``_extra_files``, ``mdtrain.json`` with the model_config, the
mdtrain version and the same attributes, so tools can read them without loading the model.
A scripted model cannot switch grad mode itself: call it with gradients enabled (forces and
virials are derivatives), e.g. under ``torch.enable_grad()``.

An exported program is traced with its derivatives: ``make_fx`` records the forward and
autograd's backward as one graph of ATen operations (``torch.export`` itself refuses
``autograd.grad`` inside a forward in torch 2.13), which ``torch.export`` then exports with
the frame and atom counts free. The parts whose sizes a fast path reads from values are
traced in their forms over every slot (`mdtrain.model.export_form`). Before it is written,
the program is run on frames of other sizes, periodic and not, and compared with the model.
Models without forces (dipole, polar, DOS, property) are exported the same way, their
outputs as their forwards give them.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable

import numpy as np
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mdtrain import __version__
from mdtrain.data.params import ParamSpec
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import FROZEN_METADATA, quiet_jit
from mdtrain.infer.program import PROGRAM_METADATA
from mdtrain.model.backend import as_reference
from mdtrain.model.export_form import export_form
from mdtrain.model.pair_energy import PairTableEnergy
from mdtrain.neighbors.layout import layout_of


def freeze_model(
    model: torch.nn.Module, output: str | os.PathLike, extra: dict | None = None
) -> None:
    """Script ``model`` (an EnergyModel, as its reference implementation: the accelerated
    backends are eager-only) in eval mode and save it with its metadata."""
    output = _check_directory(output)
    model = as_reference(model).eval()
    try:
        with quiet_jit():
            scripted = torch.jit.script(model)
    except Exception as exc:
        raise MDTrainError(
            f"freeze: the model cannot be scripted ({str(exc).splitlines()[0]})"
        ) from exc
    files = {FROZEN_METADATA: json.dumps(_metadata(model, "mdtrain-frozen", extra), sort_keys=True)}

    def save(tmp: str) -> None:
        with quiet_jit():
            torch.jit.save(scripted, tmp, _extra_files=files)

    _write(output, save)


def export_model(
    model: torch.nn.Module, output: str | os.PathLike, extra: dict | None = None
) -> None:
    """Save ``export_program(model)`` with its metadata as ``output`` (``.pt2``)."""
    output = _check_directory(output)
    program = export_program(model)
    metadata = _metadata(model, "mdtrain-exported", extra)
    files = {PROGRAM_METADATA: json.dumps(metadata, sort_keys=True)}

    def save(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            torch.export.save(program, fh, extra_files=files)

    _write(output, save)


def export_program(model: torch.nn.Module) -> torch.export.ExportedProgram:
    """``model`` (its reference implementation in eval mode, on the CPU) with its forces and
    virials as one ``torch.export`` program, checked (see the module docstring). A model with
    frame/atomic parameters takes them as its last inputs: ``fparam`` (nframes,
    numb_fparam), then ``aparam`` (nframes, natoms, numb_aparam), each only when it has them."""
    reference = as_reference(model)
    eager = ParamsForward(copy.deepcopy(reference).cpu().eval())
    # the parts with a window read from values, over every slot (model/export_form.py)
    model = ParamsForward(export_form(reference).cpu().eval())
    # sizes apart from each other and from the fixed ones (3, the neighbours, the parameter
    # widths), which tracing would tie to them
    fixed = {3, sum(model.sel), *model.widths}
    nframes = next(n for n in (2, 5, 7) if n not in fixed)
    natoms = next(n for n in (7, 11, 13) if n not in fixed | {nframes})
    example = example_frames(model, nframes, natoms, periodic=True, seed=0)
    frames = torch.export.Dim("nframes", min=1)
    atoms = torch.export.Dim("natoms", min=1)
    per_atom = {0: frames, 1: atoms}
    dims = (per_atom, {0: atoms}, {0: frames}, per_atom, per_atom)
    dims += ({0: frames},) * (model.numb_fparam > 0) + (per_atom,) * (model.numb_aparam > 0)
    try:
        with torch.enable_grad():
            traced = make_fx(model, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*example)
        program = torch.export.export(traced, example, dynamic_shapes=dims)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise MDTrainError(f"freeze: the model cannot be exported ({first})") from exc
    run = program.module()
    for nframes, size, periodic in ((1, natoms + 4, True), (3, natoms + 2, False)):
        _check_program(run, eager, example_frames(model, nframes, size, periodic))
    return program


class ParamsForward(torch.nn.Module):
    """A model whose frame/atomic parameters, when it has them, are positional inputs after
    ``shift`` (``fparam`` then ``aparam``, only those it takes): the program's signature."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        spec = ParamSpec.of_model(model)  # a combined model's from its network parts
        self.numb_fparam, self.numb_aparam = spec.numb_fparam, spec.numb_aparam
        for part in model.modules():  # a program cannot raise on values: NaN instead
            if isinstance(part, PairTableEnergy):
                part.raise_below = False
        self.widths = {w for w in (self.numb_fparam, self.numb_aparam) if w}
        self.type_map, self.rcut, self.sel = model.type_map, model.rcut, model.sel
        self.mixed_types = bool(getattr(model, "mixed_types", False))

    def forward(self, coord, atype, box, nlist, shift, *params: torch.Tensor):
        if not self.widths:  # (a dipole or polar model takes no parameters)
            return self.model(coord, atype, box, nlist, shift)
        rest = list(params)
        fparam = rest.pop(0) if self.numb_fparam else None
        aparam = rest.pop(0) if self.numb_aparam else None
        return self.model(coord, atype, box, nlist, shift, fparam, aparam)


def example_frames(
    model: torch.nn.Module, nframes: int, natoms: int, periodic: bool, seed: int = 1
) -> tuple[torch.Tensor, ...]:
    """Program inputs: ``natoms`` atoms of every type, jittered on a grid of spacing rcut/2
    in a cubic cell (zeros when not ``periodic``), with their neighbour lists."""
    rng = np.random.default_rng(seed)
    side = int(np.ceil(natoms ** (1 / 3)))
    spacing = 0.5 * model.rcut
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)
    coord = (grid[:natoms] + rng.uniform(-0.2, 0.2, (nframes, natoms, 3))) * spacing
    atype = np.sort(np.arange(natoms) % len(model.type_map))
    cell = np.eye(3) * side * spacing
    build = layout_of(model).build  # per type, or one type-mixed list
    lists = [build(c, cell if periodic else None, atype, model.rcut, model.sel) for c in coord]
    box = np.broadcast_to(cell if periodic else np.zeros((3, 3)), (nframes, 3, 3))
    params = []  # a ParamsForward's frame/atomic parameters
    if getattr(model, "numb_fparam", 0):
        params.append(torch.tensor(rng.normal(size=(nframes, model.numb_fparam))))
    if getattr(model, "numb_aparam", 0):
        params.append(torch.tensor(rng.uniform(size=(nframes, natoms, model.numb_aparam))))
    return (
        torch.tensor(coord),
        torch.tensor(atype),
        torch.tensor(np.ascontiguousarray(box)),
        torch.tensor(np.stack([nlist for nlist, _, _ in lists])),
        torch.tensor(np.stack([shift for _, shift, _ in lists])),
        *params,
    )


def _check_program(program: Callable, model: torch.nn.Module, inputs: tuple) -> None:
    """A one-line error where the program's outputs differ from the model's (a tracing
    problem must not reach a file)."""
    with torch.no_grad():
        got = program(*inputs)
        want = model(*inputs)
    for key in want:
        if not torch.allclose(got[key], want[key], rtol=1e-7, atol=1e-7):
            worst = float((got[key] - want[key]).abs().max())
            raise MDTrainError(
                f"freeze: the exported program's {key} differs from the model's by {worst:.3g} "
                f"on {inputs[0].shape[0]} frame(s) of {inputs[0].shape[1]} atoms"
            )


def _metadata(model: torch.nn.Module, kind: str, extra: dict | None) -> dict:
    return {
        "format": kind,
        "mdtrain_version": __version__,
        "torch_version": torch.__version__,
        "type_map": list(model.type_map),
        "rcut": float(model.rcut),
        "sel": [int(s) for s in model.sel],
        "mixed_types": bool(getattr(model, "mixed_types", False)),  # the list's layout
        "model_config": model.get_model_config(),
        "outputs": output_attributes(model),
        **(extra or {}),
    }


def output_attributes(model: torch.nn.Module) -> dict:
    """What a model without forces says of its outputs (`mdtrain.infer.program.ExportedModel`
    takes them): a dipole or polar model's ``kind``, ``label`` and ``tensor_size``, a DOS or
    property model's ``kind`` and ``output``, and either's ``atom_keep`` (per type); empty for
    an energy model."""
    names = ("kind", "label", "tensor_size", "output")
    found = {k: getattr(model, k) for k in names if getattr(model, k, None) is not None}
    if "label" not in found and "output" not in found:
        return {}
    return {**found, "atom_keep": [float(v) for v in model.atom_keep]}


def _check_directory(output: str | os.PathLike) -> str:
    output = os.fspath(output)
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise MDTrainError(f"freeze: output directory {directory} does not exist")
    return output


def _write(output: str, save: Callable[[str], None]) -> None:
    """``save`` to a temporary file beside ``output``, then renamed: a failure leaves no
    partial file and whatever ``output`` held before."""
    tmp = f"{output}.{os.getpid()}.tmp"
    try:
        save(tmp)
        os.replace(tmp, output)
    except (OSError, RuntimeError) as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise MDTrainError(f"freeze: cannot write {output} ({exc})") from None
