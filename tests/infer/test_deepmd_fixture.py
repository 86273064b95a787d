"""Models written by DeePMD-kit itself, read by mdtrain: the committed fixtures of
``tests/fixtures/deepmd/`` (made by its ``make_fixture.py`` with ``dp --tf train`` or, for
se_e3_tebd, ``dp --pt train``, then ``dp freeze`` and ``dp convert-backend``), one or two
per descriptor, give the energies, atom energies, forces and virials that DeePMD-kit's
``DeepPot`` gave for the same frames, stored beside them, through the model and through the
ASE calculator; ``mdtrain test`` gives the errors of those numbers. No DeePMD-kit needed:
this guards the ``.dp`` format in the default suite (the live comparison is the ``interop``
tier, tests/interop/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mdtrain.infer.load import load_model
from tests.helpers.deepmd import rel_diff
from tests.helpers.deepmd_variants import VARIANTS as DEEPMD_VARIANTS
from tests.helpers.models import evaluate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepmd"
# se_e2_a one_side: type_one_side, tanh everywhere; two_side: type_one_side false, resnet_dt
# embedding nets, exclude_types [[1, 1]], gelu fitting nets (DeePMD's tanh approximation);
# the others: tests/helpers/deepmd_variants.py (the type-mixed ones with one fitting net)
VARIANTS = list(DEEPMD_VARIANTS)
GROUPS = ["water", "triclinic", "cluster"]  # 24 atoms; 3 atoms in a cell < rcut; no cell


def test_fixtures_are_present_and_small():
    for variant in VARIANTS:
        for suffix in (".dp", ".npz"):
            path = FIXTURES / f"{variant}{suffix}"
            assert path.is_file() and path.stat().st_size < 200_000, path


@pytest.mark.parametrize("variant", VARIANTS)
def test_deepmd_written_model_gives_deepmd_numbers(variant):
    model = load_model(FIXTURES / f"{variant}.dp")
    ref = np.load(FIXTURES / f"{variant}.npz")
    assert list(model.type_map) == [str(t) for t in ref["type_map"]]
    assert float(model.rcut) == 4.0
    # DeePMD-kit's fitting: one net for all types after a type-mixed descriptor
    assert len(model.fitting.networks) == (1 if model.mixed_types else 2)
    worst = {}
    for group in GROUPS:
        coord, atype = ref[f"{group}_coord"], ref[f"{group}_atype"]
        box = ref.get(f"{group}_box")
        out = [
            evaluate(model, c, None if box is None else box[f], atype) for f, c in enumerate(coord)
        ]
        for key in ("energy", "atom_energy", "force", "virial"):
            ours = np.stack([o[key] for o in out])
            worst[(group, key)] = rel_diff(ours, ref[f"{group}_{key}"])
    bad = {k: v for k, v in worst.items() if not v < 1e-10}
    assert not bad, f"relative differences to DeePMD-kit above 1e-10: {bad}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_calculator_and_test_command_give_deepmd_numbers(variant, tmp_path):
    """The ASE calculator on the ``.dp`` file (energy, atom energies, forces, stress from
    DeePMD-kit's virial), and ``mdtrain test`` on a system labelled with DeePMD-kit's answers:
    errors of ~0 relative to the labels."""
    from ase import Atoms

    from mdtrain.calculator import MDTrainCalculator
    from mdtrain.cli import main
    from tests.helpers.datagen import write_npy_system

    path = FIXTURES / f"{variant}.dp"
    ref = np.load(FIXTURES / f"{variant}.npz")
    calc = MDTrainCalculator(str(path))
    type_map = [str(t) for t in ref["type_map"]]
    for group in ("water", "cluster"):
        coord, atype = ref[f"{group}_coord"], ref[f"{group}_atype"]
        box = ref.get(f"{group}_box")
        for f, c in enumerate(coord):
            cell = None if box is None else box[f]
            atoms = Atoms(
                [type_map[t] for t in atype], positions=c, cell=cell, pbc=cell is not None
            )
            atoms.calc = calc
            assert rel_diff(atoms.get_potential_energy(), ref[f"{group}_energy"][f]) < 1e-10
            assert rel_diff(atoms.get_potential_energies(), ref[f"{group}_atom_energy"][f]) < 1e-10
            assert rel_diff(atoms.get_forces(), ref[f"{group}_force"][f]) < 1e-10
            if cell is not None:
                virial = -atoms.get_stress(voigt=False) * atoms.get_volume()
                assert rel_diff(virial, ref[f"{group}_virial"][f]) < 1e-10
    system = write_npy_system(
        tmp_path / "water",
        ref["water_coord"],
        ref["water_atype"],
        type_map,
        ref["water_box"],
        ref["water_energy"],
        ref["water_force"],
        ref["water_virial"],
    )
    figures = tmp_path / "figures.json"
    assert main(["test", "-m", str(path), "-s", system, "--json", str(figures)]) == 0
    total = json.loads(figures.read_text())["total"]
    scale = {
        "energy_rmse": np.abs(ref["water_energy"]).max(),
        "force_rmse": np.abs(ref["water_force"]).max(),
        "virial_rmse": np.abs(ref["water_virial"]).max(),
    }
    for key, size in scale.items():
        assert total[key] < 1e-10 * size, (key, total[key])
