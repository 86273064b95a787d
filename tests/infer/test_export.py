"""``mdtrain freeze -o model.pt2``: the ``torch.export`` program gives the eager model's
energies, atomic energies, forces and virials to 1e-12 in float64 (periodic and not, any frame
and atom count), forces equal to finite differences of its own energy, runs in a fresh
process that never imports mdtrain and without autograd; the calculator, ``mdtrain test`` and
``mdtrain model-devi`` take it, on another device too; error paths. Exporting traces the model
twice and loading a program rebuilds its graph, each seconds: one export and a few loads in
the default run, other architectures under ``-m slow``."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch
from ase import Atoms

from mdtrain.cli import main
from mdtrain.errors import MDTrainError
from mdtrain.infer.calculator import MDTrainCalculator
from mdtrain.infer.change_bias import read_model
from mdtrain.infer.freeze import example_frames, export_program
from mdtrain.infer.load import load_model
from mdtrain.infer.program import ExportedModel, is_exported_program
from mdtrain.infer.test import evaluate_system
from mdtrain.model.backend import as_reference
from mdtrain.neighbors.nlist import build_nlist
from tests.helpers.committee import member_model, write_model
from tests.helpers.datagen import random_water_like, water_labeled, write_npy_system
from tests.helpers.model_files import (
    assert_same_model_devi,
    assert_same_test_figures,
)
from tests.helpers.models import (
    save_tiny_checkpoint,
    small_config,
    tiny_model,
    triclinic,
    water_batch,
)
from tests.helpers.placement import OTHER, OtherDevice, module_devices
from tests.helpers.processes import python_without_mdtrain

KEYS = ("energy", "atom_energy", "force", "virial")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, str]:
    """(checkpoint, program) of the tiny model, the program written by the command."""
    tmp = tmp_path_factory.mktemp("export")
    ckpt = save_tiny_checkpoint(tmp / "model.ckpt.pt")
    out = tmp / "model.pt2"
    assert main(["freeze", ckpt, "-o", str(out)]) == 0
    return ckpt, str(out)


@pytest.fixture(scope="module")
def program(exported) -> ExportedModel:
    """The exported program, loaded once."""
    return load_model(exported[1])


def water_inputs(model, nframes: int, nmol: int, edge: float, periodic: bool, seed: int):
    return water_batch(model.rcut, model.sel, nframes, nmol, edge, periodic, seed)


def assert_equal_outputs(got: dict, want: dict, tol: float = 1e-12) -> None:
    for key in KEYS:
        torch.testing.assert_close(got[key], want[key].detach(), rtol=0, atol=tol, msg=key)


@pytest.mark.parametrize("periodic", [True, False])
def test_program_equals_the_eager_model(exported, program, periodic):
    ckpt, path = exported
    assert isinstance(program, ExportedModel) and is_exported_program(path)
    assert not is_exported_program(ckpt)
    reference = as_reference(load_model(ckpt))
    fastest = load_model(ckpt)
    # frame and atom counts other than those traced, one molecule to 27
    for nframes, nmol, edge, seed in ((1, 1, 7.0, 1), (3, 8, 6.4, 2), (2, 27, 8.5, 3)):
        inputs = water_inputs(reference, nframes, nmol, edge, periodic, seed)
        want = reference(*inputs)
        assert want["force"].abs().max() > 1e-3  # not a flat model
        assert_equal_outputs(program(*inputs), want)
        assert_equal_outputs(program(*inputs), fastest(*inputs))


def test_program_forces_are_derivatives_of_its_energy(program):
    """Central differences of the program's own energy (non-periodic, atoms moved one by
    one) give its forces."""
    coord, atype, box, _, _ = water_inputs(program, 1, 2, 6.0, False, 4)

    def energy(x: torch.Tensor) -> float:
        nlist, shift, _ = build_nlist(x[0].numpy(), None, atype.numpy(), program.rcut, program.sel)
        out = program(x, atype, None, torch.tensor(nlist)[None], torch.tensor(shift)[None])
        return float(out["energy"][0])

    nlist, shift, _ = build_nlist(coord[0].numpy(), None, atype.numpy(), program.rcut, program.sel)
    force = program(coord, atype, None, torch.tensor(nlist)[None], torch.tensor(shift)[None])
    h = 1e-5
    for i in range(coord.shape[1]):
        for k in range(3):
            plus, minus = coord.clone(), coord.clone()
            plus[0, i, k] += h
            minus[0, i, k] -= h
            numeric = -(energy(plus) - energy(minus)) / (2 * h)
            assert abs(numeric - float(force["force"][0, i, k])) < 1e-6


FRESH = r"""
import sys, torch
args = torch.load(sys.argv[2])
with torch.no_grad():  # the program holds its derivatives: no autograd needed
    out = torch.export.load(sys.argv[1]).module()(*args)
torch.save({k: v for k, v in out.items()}, sys.argv[3])
bad = [m for m in sys.modules if m.split(".")[0] in ("mdtrain", "vesin", "ase", "tests")]
assert not bad, bad
print(sorted(out))
"""


@pytest.mark.multiprocess
def test_program_in_fresh_process_without_mdtrain(exported, tmp_path):
    """Plain torch runs the file; a non-periodic frame passes a zero cell."""
    ckpt, path = exported
    model = load_model(ckpt)
    coord, atype, _, nlist, shift = water_inputs(model, 2, 8, 6.4, False, 5)
    torch.save(
        (coord, atype, torch.zeros(2, 3, 3, dtype=torch.float64), nlist, shift), tmp_path / "in.pt"
    )
    proc = python_without_mdtrain(
        FRESH, path, str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['atom_energy', 'energy', 'force', 'virial']"
    assert_equal_outputs(torch.load(tmp_path / "out.pt"), model(coord, atype, None, nlist, shift))


def test_program_metadata(exported, program):
    assert program.type_map == ["O", "H"] and program.rcut == 4.0 and program.sel == [16, 32]
    with zipfile.ZipFile(exported[1]) as zf:  # where torch.export.load(extra_files=) looks
        name = next(n for n in zf.namelist() if n.endswith("/extra/mdtrain.json"))
        meta = json.loads(zf.read(name))
    assert meta == program.metadata
    assert meta["format"] == "mdtrain-exported" and meta["step"] == 0
    assert meta["model_config"] == tiny_model().get_model_config()


@pytest.mark.slow
def test_calculator_test_and_model_devi_take_a_program(exported, tmp_path):
    """(Slow: ``mdtrain test`` and ``model-devi`` each load the program, seconds; the default
    run has their type-mixed cases in tests/infer/test_export_registry.py.)"""
    ckpt, path = exported
    coords, types, boxes = random_water_like(2, 8, 6.4, seed=7, triclinic=True)
    symbols = ["OH"[t] for t in types]
    calculators = [MDTrainCalculator(ckpt), MDTrainCalculator(path)]
    for periodic in (True, False):
        got = []
        for calc in calculators:
            atoms = Atoms(symbols, positions=coords[0], cell=boxes[0], pbc=periodic)
            atoms.calc = calc
            got.append(
                (atoms.get_potential_energy(), atoms.get_forces(), atoms.get_potential_energies())
            )
            if periodic:
                got[-1] += (atoms.get_stress(),)
        for want, have in zip(*got):
            np.testing.assert_allclose(have, want, rtol=0, atol=1e-12)

    system = write_npy_system(tmp_path / "sys", **water_labeled(nframes=3, seed=6))
    assert "force_rmse" in assert_same_test_figures(ckpt, path, system, tmp_path)

    other = write_model(member_model(1), tmp_path / "other.pt")
    assert_same_model_devi(ckpt, path, other, system, tmp_path)


def test_program_on_another_device(exported, program, water_system):
    """Loaded onto another device (its graph's constants moved too), the program gives the
    CPU's numbers and mixes no CPU tensor in (``OtherDevice``)."""
    from mdtrain.data import open_system

    system = open_system(water_system, ["O", "H"])
    expected = evaluate_system(program, system, 4)
    coord = random_water_like(1, 4, 5.2, seed=3)[0][0]
    atoms = Atoms("OHHOHHOHHOHH", positions=coord, cell=triclinic(5.2, seed=3), pbc=True)
    forces = MDTrainCalculator(program).get_forces(atoms)
    with OtherDevice():
        moved = load_model(exported[1], OTHER)
        assert module_devices(moved) == {OTHER}
        got = evaluate_system(moved, system, 4, OTHER)
        calc = MDTrainCalculator(moved, device=OTHER)
        np.testing.assert_array_equal(calc.get_forces(atoms), forces)
    for key in ("energy", "force", "virial"):
        np.testing.assert_array_equal(got.pred[key], expected.pred[key])


@pytest.mark.slow
def test_export_of_other_architectures():
    """Both-side type embedding, excluded type pairs and atom types, another activation,
    three types: exported and equal to the eager model (freeze checks two frame sizes
    itself; these are others)."""
    config = small_config(
        {"type_one_side": False, "exclude_types": [[0, 1]], "activation_function": "gelu"},
        atom_exclude_types=[1],
    )
    config["type_map"] = ["O", "H", "C"]
    config["descriptor"]["sel"] = [12, 24, 4]
    model = tiny_model(seed=3, config=config)
    program = export_program(model).module()
    for nframes, natoms, periodic in ((1, 5, True), (2, 19, False)):
        inputs = example_frames(model, nframes, natoms, periodic, seed=nframes)
        want = model(*inputs)
        assert want["force"].abs().max() > 1e-3
        assert_equal_outputs(program(*inputs), want)


def test_program_errors(exported, tmp_path):
    ckpt, path = exported
    with pytest.raises(MDTrainError, match="already an exported"):
        main(["--debug", "freeze", path, "-o", str(tmp_path / "again.pt2")])
    with pytest.raises(MDTrainError, match="model.pt2: an exported program's weights cannot"):
        read_model(path)
    broken = tmp_path / "broken.pt2"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(broken, "w") as zout:
        for item in zin.infolist():  # a program with its weights missing
            if "/data/weights/" not in item.filename:
                zout.writestr(item, zin.read(item.filename))
    assert is_exported_program(broken)
    with pytest.raises(MDTrainError, match="broken.pt2: cannot load the exported program"):
        load_model(broken)
    bare = tmp_path / "bare.pt2"  # a program without mdtrain's metadata
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(bare, "w") as zout:
        for item in zin.infolist():
            if not item.filename.endswith("/extra/mdtrain.json"):
                zout.writestr(item, zin.read(item.filename))
    with pytest.raises(MDTrainError, match="bare.pt2: an exported program without"):
        load_model(bare)


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_torchscript_freeze_and_load_warn_nothing(tmp_path):
    """torch 2.13 deprecates TorchScript; freezing to and loading a .pth says nothing of it."""
    ckpt = save_tiny_checkpoint(tmp_path / "c.pt")
    assert main(["freeze", ckpt, "-o", str(tmp_path / "m.pth")]) == 0
    load_model(tmp_path / "m.pth")
    load_model(tmp_path / "m.pth", scripted=True)
