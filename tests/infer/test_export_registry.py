"""``mdtrain freeze -o model.pt2`` over the descriptor registry and the model kinds: every
registered descriptor (and the hybrids with type-mixed members), the dipole and polar models
of the descriptors with a rotation matrix, DOS and property models, the combined models
(DP+ZBL and ``linear_ener`` with a table, each with a type-mixed part, and a table alone)
and frame/atomic parameters. One export each, run at two atom and frame counts other than the traced ones
(periodic and not): every output equals the eager model's to 1e-12 in float64, forces and
virials included. The type-mixed descriptors' fast paths read sizes from values (se_atten's
attention window, se_e3's block windows, se_e3_tebd's pairs of real slots); the program runs
their forms over every slot (``mdtrain.model.export_form``), which must still equal the
eager model.

An se_atten model is exported once by the command and taken by the calculator, ``mdtrain
test`` and ``mdtrain model-devi``. Exporting takes tens of seconds a model and loading a
program seconds (both trace with symbolic sizes): the default run exports that one model
only; the others are ``slow``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from ase import Atoms

from mdtrain.cli import main
from mdtrain.data.params import ParamSpec
from mdtrain.infer.calculator import MDTrainCalculator
from mdtrain.infer.freeze import example_frames, export_model
from mdtrain.infer.load import load_model
from mdtrain.infer.program import ExportedModel
from mdtrain.model import EnergyModel
from mdtrain.model.combined_build import build_combined_model
from tests.helpers.datagen import (
    random_water_like,
    tensor_labels,
    water_labeled,
    write_npy_system,
)
from tests.helpers.descriptor_battery import battery_config, case_id, layout_cases
from tests.helpers.model_files import (
    assert_same_model_devi,
    assert_same_test_figures,
    random_combined_model,
)
from tests.helpers.models import (
    INVARIANT_CASES,
    TENSOR_DESCRIPTORS,
    make_invariant_model,
    make_tensor_model,
    save_tiny_checkpoint,
    set_random_stats,
)
from tests.helpers.output_data import dos_labels
from tests.helpers.pair_tables import write_table, zbl_table

#: (frames, atoms, periodic) the programs run at: sizes other than the traced ones (2 or 5
#: frames of 7, 11 or 13 atoms), from one export
SIZES = ((1, 5, True), (2, 19, False))
#: the case the default run exports, once, by the command (the others are slow)
QUICK = ("se_atten", {})


def energy_model(case: tuple[str, dict], **fitting) -> EnergyModel:
    name, variant = case
    config = battery_config(name, variant)
    config["fitting_net"].update(fitting)
    return set_random_stats(EnergyModel(config)).eval()


def combined_model(kind: str, table) -> torch.nn.Module:
    """DP+ZBL with an se_atten part, ``linear_ener`` of an se_atten part, an se_e2_a part
    and a pair table, or the table alone (``pairtab``)."""
    atten = battery_config("se_atten")
    pairtab = {"type": "pairtab", "tab_file": str(table), "rcut": 3.0, "sel": 40}
    if kind == "pairtab":
        return build_combined_model({**pairtab, "type_map": ["O", "H"]}).eval()
    if kind == "zbl":
        cfg = {**atten, "use_srtab": str(table), "sw_rmin": 0.8, "sw_rmax": 1.2}
    else:
        plain = battery_config("se_e2_a")
        plain["descriptor"].update(rcut=2.5, sel=[6, 12], seed=5)
        cfg = {"type": "linear_ener", "type_map": ["O", "H"],
               "models": [atten, plain, pairtab], "weights": [0.5, -2.0, 0.25]}  # fmt: skip
    return random_combined_model(cfg)


def assert_program_equals_model(program, model) -> None:
    """``program`` (one export) against the eager ``model`` at `SIZES`, every output."""
    for nframes, natoms, periodic in SIZES:
        inputs = example_frames(model, nframes, natoms, periodic, seed=nframes)
        params = []  # frame/atomic parameters, as the program takes them
        rng = np.random.default_rng(natoms)
        spec = ParamSpec.of_model(model)
        if spec.numb_fparam:
            params.append(torch.tensor(rng.normal(size=(nframes, spec.numb_fparam))))
        if spec.numb_aparam:
            params.append(torch.tensor(rng.uniform(size=(nframes, natoms, spec.numb_aparam))))
        want = model(*inputs, *params)
        got = program(*inputs, *params)
        assert sorted(got) == sorted(want)
        assert all(v.abs().max() > 1e-3 for v in want.values())  # not a flat model
        for key, value in want.items():
            assert got[key].shape == value.shape, key
            torch.testing.assert_close(got[key], value.detach(), rtol=0, atol=1e-12, msg=key)


def assert_calculators_agree(program, model) -> None:
    """The calculator's whole and atomic output of a model without forces, the program's
    and the eager model's, on atoms in their own order."""
    name = getattr(model, "label", None) or model.output
    coords, types, boxes = random_water_like(1, 4, 5.2, seed=3, triclinic=True)
    atoms = Atoms(["OH"[t] for t in types], positions=coords[0], cell=boxes[0], pbc=True)
    for key in (name, f"atom_{name}"):
        want = MDTrainCalculator(model).get_property(key, atoms)
        got = MDTrainCalculator(program).get_property(key, atoms)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def assert_test_figures_agree(model, program: str, labels, tmp_path) -> None:
    """``mdtrain test`` on ``program`` gives the figures of ``model``'s checkpoint, on a
    system with ``labels(coords, types)``."""
    coords, types, boxes = random_water_like(2, 4, 6.0, seed=2)
    extra = labels(coords, types)
    system = write_npy_system(tmp_path / "sys", coords, types, ["O", "H"], boxes, extra=extra)
    ckpt = save_tiny_checkpoint(tmp_path / "m.pt", model)
    assert len(assert_same_test_figures(ckpt, program, system, tmp_path)) > 2


def exported(model, path) -> ExportedModel:
    export_model(model, path)
    return load_model(path)


# every registered descriptor (and the hybrids of type-mixed members): `layout_cases`
ENERGY = [
    pytest.param(c, id=case_id(c), marks=[] if c == QUICK else [pytest.mark.slow])
    for c in layout_cases()
]


@pytest.mark.parametrize("case", ENERGY)
def test_energy_models_of_every_descriptor(case, request, tmp_path):
    model = energy_model(case)
    if case == QUICK:  # the command's program, which the tests below take too
        program = request.getfixturevalue("atten_program")
    else:
        program = exported(model, tmp_path / "m.pt2")
    assert program.mixed_types == model.mixed_types
    assert_program_equals_model(program, model)


@pytest.mark.slow
@pytest.mark.parametrize("descriptor", list(TENSOR_DESCRIPTORS))
@pytest.mark.parametrize("kind", ["dipole", "polar"])
def test_tensor_models(kind, descriptor, tmp_path):
    model = make_tensor_model(kind, seed=1, descriptor=descriptor).eval()
    program = exported(model, tmp_path / "m.pt2")
    assert (program.kind, program.label) == (model.kind, model.label)
    torch.testing.assert_close(program.atom_keep, model.atom_keep, rtol=0, atol=0)
    assert_program_equals_model(program, model)
    assert_calculators_agree(program, model)
    if descriptor == "se_atten":  # (loading a program takes seconds: one descriptor)
        assert_test_figures_agree(model, str(tmp_path / "m.pt2"), tensor_labels, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(INVARIANT_CASES))
def test_dos_and_property_models(case, tmp_path):
    model = make_invariant_model(case, seed=1).eval()
    program = exported(model, tmp_path / "m.pt2")
    assert (program.kind, program.output) == (model.kind, model.output)
    assert_program_equals_model(program, model)
    assert_calculators_agree(program, model)
    if case == "dos":  # (loading a program takes seconds: one case)
        labels = lambda c, t: dos_labels(c, t, 6.0, model.width)  # noqa: E731
        assert_test_figures_agree(model, str(tmp_path / "m.pt2"), labels, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zbl", "linear_ener", "pairtab"])
def test_combined_models_with_a_type_mixed_part(kind, tmp_path):
    table = write_table(tmp_path / "t.txt", zbl_table(["O", "H"], 0.2, 4.0, 0.02, zero_from=3.6))
    model = combined_model(kind, table)
    assert_program_equals_model(exported(model, tmp_path / "m.pt2"), model)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["se_atten", "hybrid"])
def test_frame_and_atomic_parameters(name, tmp_path):
    variant = {"members": "mixed"} if name == "hybrid" else {}
    model = energy_model((name, variant), numb_fparam=2, numb_aparam=1)
    assert_program_equals_model(exported(model, tmp_path / "m.pt2"), model)


@pytest.fixture(scope="module")
def atten_files(tmp_path_factory) -> tuple[str, str, str]:
    """(checkpoint, program, another se_atten model's checkpoint): the program written by
    ``mdtrain freeze``."""
    tmp = tmp_path_factory.mktemp("atten")
    model = energy_model(QUICK)
    ckpt = save_tiny_checkpoint(tmp / "model.ckpt.pt", model)
    out = tmp / "model.pt2"
    assert main(["freeze", ckpt, "-o", str(out)]) == 0
    other = battery_config("se_atten", seed=7)
    other_ckpt = save_tiny_checkpoint(tmp / "other.pt", set_random_stats(EnergyModel(other), 3))
    return ckpt, str(out), other_ckpt


@pytest.fixture(scope="module")
def atten_program(atten_files) -> ExportedModel:
    return load_model(atten_files[1])


@pytest.fixture
def loaded_once(atten_files, atten_program, monkeypatch) -> None:
    """The commands below read the program through `load_model` as ever; its graph, rebuilt
    by every load (seconds), comes from the fixture's load of the same file."""
    import mdtrain.infer.load as loading

    real = loading.load_program

    def load_program(path, device="cpu"):
        same = os.path.samefile(path, atten_files[1]) and torch.device(device).type == "cpu"
        return atten_program if same else real(path, device)

    monkeypatch.setattr(loading, "load_program", load_program)


@pytest.fixture(scope="module")
def water_system(tmp_path_factory) -> str:
    return write_npy_system(tmp_path_factory.mktemp("sys") / "sys", **water_labeled(3, 6, seed=6))


def test_calculator_takes_a_type_mixed_program(atten_files, atten_program):
    """(The program loaded once: loading rebuilds its graph, seconds; the calculator loads
    a path with the same `load_model`.)"""
    ckpt = atten_files[0]
    coords, types, boxes = random_water_like(1, 6, 5.6, seed=7, triclinic=True)
    symbols = ["OH"[t] for t in types]
    for periodic in (True, False):
        got = []
        for model in (ckpt, atten_program):
            atoms = Atoms(symbols, positions=coords[0], cell=boxes[0], pbc=periodic)
            atoms.calc = MDTrainCalculator(model)
            got.append([atoms.get_potential_energy(), atoms.get_forces()])
            got[-1] += [atoms.get_stress()] if periodic else []
        for want, have in zip(*got, strict=True):
            np.testing.assert_allclose(have, want, rtol=0, atol=1e-12)
        assert np.abs(got[0][1]).max() > 1e-3


def test_test_command_takes_a_type_mixed_program(atten_files, water_system, loaded_once, tmp_path):
    ckpt, path, _ = atten_files
    assert "force_rmse" in assert_same_test_figures(ckpt, path, water_system, tmp_path)


def test_model_devi_takes_a_type_mixed_program(atten_files, water_system, loaded_once, tmp_path):
    ckpt, path, other = atten_files
    assert_same_model_devi(ckpt, path, other, water_system, tmp_path)
