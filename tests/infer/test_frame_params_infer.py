"""Inference with frame and atomic parameters: the ASE calculator (atoms.info["fparam"],
atoms.arrays["aparam"]), a frozen .pth, model-devi on a deepmd system, and their errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms

from mdtrain.calculator import CommitteeCalculator, MDTrainCalculator
from mdtrain.data import open_system
from mdtrain.errors import MDTrainError
from mdtrain.infer.freeze import export_model, freeze_model
from mdtrain.infer.load import load_model
from mdtrain.infer.model_devi import evaluate_committee
from mdtrain.model import EnergyModel
from mdtrain.neighbors.nlist import build_nlist
from tests.helpers.datagen import water_labeled, write_npy_system
from tests.helpers.frame_params import PARAMS, add_params
from tests.helpers.models import set_random_stats, small_config, water_like


def _model(seed: int = 2, **fitting) -> EnergyModel:
    cfg = small_config(fitting={**PARAMS, "seed": seed, **fitting})
    model = set_random_stats(EnergyModel(cfg), seed)
    with torch.no_grad():
        if model.fitting.numb_fparam:
            model.fitting.fparam_avg.copy_(torch.tensor([1.0, -2.0], dtype=torch.float64))
            model.fitting.fparam_inv_std.copy_(torch.tensor([3.0, 2.0], dtype=torch.float64))
        if model.fitting.numb_aparam:
            model.fitting.aparam_inv_std.fill_(2.0)
    return model.eval()


def _direct(model, coord, box, atype, fp, ap):
    nlist, shift, _ = build_nlist(coord, box, atype, float(model.rcut), list(model.sel))
    out = model(
        torch.tensor(coord)[None],
        torch.tensor(atype),
        torch.tensor(box)[None],
        torch.tensor(nlist)[None],
        torch.tensor(shift)[None],
        None if fp is None else torch.tensor(fp)[None],
        None if ap is None else torch.tensor(ap)[None],
    )
    return {k: v.detach()[0].numpy() for k, v in out.items()}


@pytest.fixture
def atoms_and_params():
    box = np.diag([6.0, 6.2, 5.8])
    coord, atype = water_like(3, box, seed=5)
    symbols = ["O" if t == 0 else "H" for t in atype]
    rng = np.random.default_rng(0)
    fp, ap = rng.normal(size=2), rng.uniform(size=(len(atype), 1))
    atoms = Atoms(symbols, positions=coord, cell=box, pbc=True)
    atoms.info["fparam"] = fp
    atoms.arrays["aparam"] = ap
    return atoms, coord, box, atype, fp, ap


def test_calculator_and_frozen_model(tmp_path, atoms_and_params):
    atoms, coord, box, atype, fp, ap = atoms_and_params
    model = _model()
    want = _direct(model, coord, box, atype, fp, ap)
    atoms.calc = MDTrainCalculator(model)
    assert atoms.get_potential_energy() == pytest.approx(float(want["energy"]), abs=1e-10)
    np.testing.assert_allclose(atoms.get_forces(), want["force"], atol=1e-10)
    freeze_model(model, tmp_path / "frozen.pth")
    atoms.calc = MDTrainCalculator(str(tmp_path / "frozen.pth"))
    assert atoms.get_potential_energy() == pytest.approx(float(want["energy"]), abs=1e-10)
    # the parameters matter: another fparam gives another energy
    atoms.info["fparam"] = fp + 1.0
    atoms.calc = MDTrainCalculator(model)
    assert abs(atoms.get_potential_energy() - float(want["energy"])) > 1e-6


@pytest.mark.parametrize(
    "fitting",
    [{}, {"numb_aparam": 0, "default_fparam": [0.5, -1.0]}, {"numb_fparam": 0}],
    ids=["both", "fparam-with-default", "aparam"],
)
def test_exported_program_takes_the_parameters(tmp_path, atoms_and_params, fitting):
    """freeze -o model.pt2 of a model with frame/atomic parameters: the program equals the
    eager model to 1e-12 (float64), on the calculator's frame and through `load_model`."""
    atoms, coord, box, atype, fp, ap = atoms_and_params
    model = _model(**fitting)
    fp = fp if model.fitting.numb_fparam else None
    ap = ap if model.fitting.numb_aparam else None
    export_model(model, tmp_path / "frozen.pt2")
    program = load_model(str(tmp_path / "frozen.pt2"))
    for params in [(fp, ap)] + ([(None, ap)] if fitting.get("default_fparam") else []):
        want, got = (_direct(m, coord, box, atype, *params) for m in (model, program))
        for key in ("energy", "atom_energy", "force", "virial"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-12, atol=1e-12)
    if fp is not None:
        atoms.info["fparam"] = fp
        atoms.calc = MDTrainCalculator(str(tmp_path / "frozen.pt2"))
        want = _direct(model, coord, box, atype, fp, ap)
        assert atoms.get_potential_energy() == pytest.approx(float(want["energy"]), abs=1e-10)
        other = _direct(model, coord, box, atype, fp + 1.0, ap)["energy"]
        assert abs(float(other) - float(want["energy"])) > 1e-6  # the parameters matter


def test_calculator_errors(atoms_and_params):
    atoms, *_ = atoms_and_params
    calc = MDTrainCalculator(_model())
    del atoms.info["fparam"]
    atoms.calc = calc
    with pytest.raises(MDTrainError, match=r'atoms.info\["fparam"\]'):
        atoms.get_potential_energy()
    atoms.info["fparam"] = [1.0, 2.0, 3.0]
    with pytest.raises(MDTrainError, match="3 values, the model has numb_fparam = 2"):
        atoms.get_potential_energy()
    atoms.info["fparam"] = [1.0, 2.0]
    del atoms.arrays["aparam"]
    with pytest.raises(MDTrainError, match=r'atoms.arrays\["aparam"\]'):
        atoms.get_potential_energy()
    # with default_fparam, no atoms.info["fparam"] is needed
    atoms.arrays["aparam"] = np.ones(len(atoms))
    atoms.info.pop("fparam")
    atoms.calc = MDTrainCalculator(_model(default_fparam=[1.0, 2.0]))
    e_default = atoms.get_potential_energy()
    atoms.info["fparam"] = [1.0, 2.0]
    atoms.calc = MDTrainCalculator(_model(default_fparam=[1.0, 2.0]))
    assert atoms.get_potential_energy() == pytest.approx(e_default, abs=1e-12)


def test_model_devi_and_committee_calculator(tmp_path, atoms_and_params):
    path = write_npy_system(tmp_path / "sys", **water_labeled(3, 4, 6.0, 1))
    add_params(path, 2, 1, seed=4)
    models = [_model(2), _model(3)]
    system = open_system(path, ["O", "H"])
    out = evaluate_committee(models, system)
    frames = system.frames([0, 1, 2])
    for k, model in enumerate(models):
        for f in range(3):
            want = _direct(
                model,
                frames["coord"][f],
                frames["box"][f],
                system.atype,
                frames["fparam"][f],
                frames["aparam"][f],
            )
            assert out.energy[k, f] == pytest.approx(float(want["energy"]), abs=1e-10)
            # model-devi keeps the file's atom order
            np.testing.assert_allclose(
                out.force[k, f][system.atom_order], want["force"], atol=1e-10
            )
    atoms, coord, box, atype, fp, ap = atoms_and_params
    atoms.calc = CommitteeCalculator(models)
    mean = np.mean([_direct(m, coord, box, atype, fp, ap)["energy"] for m in models])
    assert atoms.get_potential_energy() == pytest.approx(float(mean), abs=1e-10)
    assert load_model(str(_frozen(models[0], tmp_path))).model_config_json


def _frozen(model, tmp_path):
    path = tmp_path / "m.pth"
    freeze_model(model, path)
    return path
