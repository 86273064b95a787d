"""Descriptors other than se_e2_a (covered by test_export.py and test_deepmd_trained.py)
against DeePMD-kit, both ways:

- mdtrain's model, frozen to ``.dp`` by ``mdtrain freeze``, converted by DeePMD-kit's
  PyTorch build (``dp convert-backend model.dp model.pth``, the environment that
  ``MDTRAIN_DEEPMD_PT_PYTHON`` names: the ``deepmd_pt`` fixture; skipped without it) and evaluated by its ``DeepPot``:
  energies, atom energies, forces and virials equal mdtrain's to 1e-10 of their largest
  magnitude (float64); DeePMD's numpy ``.dp`` evaluator gives the energies. DeePMD-kit's
  TensorFlow backend (``.pb``) is run too and its energy difference printed, not asserted:
  for se_e2_r and se_e3 it differs from DeePMD-kit's own numpy and PyTorch evaluation of the
  same file (energies about 20 % and 99 % apart, measured with 3.2.0);
- a model trained by DeePMD-kit (``dp --pt train``, 20 steps), frozen (``model.pth``) and
  converted to ``.dp``: mdtrain reads it and gives DeepPot's numbers on ``model.pth`` to
  1e-10, and ``mdtrain test -m model.dp`` gives ``dp --pt test -m model.pth``'s errors.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.infer.load import load_model
from tests.helpers.datagen import random_water_like, water_labeled, write_npy_system
from tests.helpers.deepmd import deepmd_input, frames_npz, rel_diff
from tests.helpers.descriptor_battery import battery_config
from tests.helpers.models import evaluate, save_tiny_checkpoint, set_random_stats

pytestmark = pytest.mark.interop

KEYS = ("energy", "atom_energy", "force", "virial")
# descriptor -> settings of the cases exported (those with a .dp form)
EXPORTED = {
    "se_e2_r": {
        "one_side": {"type_one_side": True},
        "exclude": {"type_one_side": True, "exclude_types": [[1, 1]]},
    },
    "se_e3": {"plain": {}, "exclude": {"exclude_types": [[0, 1]], "set_davg_zero": True}},
    "hybrid": {
        "one_side": {"type_one_side": True},
        "mixed": {"members": "mixed"},  # type-mixed: se_atten beside se_e2_a
        "mixed-tebd": {"members": "mixed-tebd"},  # se_e2_r, se_e3_tebd, se_atten_v2
    },
    "se_atten": {
        "concat": {},
        "strip": {"tebd_input_mode": "strip", "smooth_type_embedding": True},
    },
    "se_atten_v2": {"default": {"exclude_types": [[0, 1]]}},
    "se_e3_tebd": {"concat": {}, "strip": {"tebd_input_mode": "strip"}},
}
# descriptor -> DeePMD-kit input settings of the model it trains
TRAINED = {
    "se_e2_r": {"type": "se_e2_r", "type_one_side": True, "axis_neuron": None},
    "se_e3": {"type": "se_e3", "axis_neuron": None, "rcut": 3.5, "neuron": [2, 4]},
    "hybrid": {
        "type": "hybrid",
        "list": [
            {"type": "se_e2_a", "rcut": 3.0, "rcut_smth": 0.5, "sel": [8, 16], "neuron": [4, 8]},
            {"type": "se_e2_r", "rcut": 4.0, "rcut_smth": 0.5, "sel": [16, 32], "neuron": [3, 6]},
        ],
        **dict.fromkeys(("rcut", "rcut_smth", "sel", "neuron", "axis_neuron"), None),
        **dict.fromkeys(("precision", "seed"), None),
    },
    # type-mixed: se_atten beside se_e2_a (DeePMD-kit draws the se_e2_a blocks from the
    # type-mixed list)
    "hybrid-mixed": {
        "type": "hybrid",
        "list": [
            {"type": "se_e2_a", "rcut": 3.0, "rcut_smth": 0.5, "sel": [8, 16], "neuron": [4, 8]},
            {
                "type": "se_atten",
                "rcut": 4.0,
                "rcut_smth": 0.5,
                "sel": 40,
                "neuron": [4, 8],
                "axis_neuron": 2,
                "tebd_dim": 3,
                "attn": 6,
                "attn_layer": 1,
            },
        ],
        **dict.fromkeys(("rcut", "rcut_smth", "sel", "neuron", "axis_neuron"), None),
        **dict.fromkeys(("precision", "seed"), None),
    },
}
for _name in ("hybrid", "hybrid-mixed"):
    for _member in TRAINED[_name]["list"]:
        _member.update(precision="float64", seed=1)
        if _member["type"] != "se_atten":
            _member["type_one_side"] = True


def ours(model, coord, atype, box) -> dict[str, np.ndarray]:
    out = [evaluate(model, c, None if box is None else box[f], atype) for f, c in enumerate(coord)]
    return {k: np.stack([o[k] for o in out]) for k in KEYS}


CASES = [(d, c) for d, cases in EXPORTED.items() for c in cases]


@pytest.mark.parametrize(("name", "case"), CASES, ids=[f"{d}-{c}" for d, c in CASES])
def test_deepmd_evaluates_the_export_as_mdtrain(deepmd, deepmd_pt, tmp_path, name, case):
    from mdtrain.model import EnergyModel

    model = set_random_stats(EnergyModel(battery_config(name, EXPORTED[name][case]))).eval()
    ckpt = save_tiny_checkpoint(tmp_path / "model.pt", model)
    assert main(["freeze", ckpt, "-o", str(tmp_path / "model.dp")]) == 0
    groups = {
        "water": random_water_like(2, 8, 6.4, seed=21),
        "triclinic": random_water_like(2, 1, 3.3, seed=22, triclinic=True),
        "cluster": (*random_water_like(2, 4, 6.0, seed=23)[:2], None),
    }
    jobs: dict = {"pb": {"convert": [["model.dp", "model.pb"]], "evaluate": []}}
    jobs["pth"] = {"convert": [["model.dp", "model.pth"]], "evaluate": []}
    for group, (coord, atype, box) in groups.items():
        frames_npz(tmp_path / f"{group}.npz", coord, atype, box)
        for kind, job in (("pb", "pb"), ("dp", "pb"), ("pth", "pth")):
            jobs[job]["evaluate"].append(
                {"model": f"model.{kind}", "frames": f"{group}.npz", "out": f"{group}-{kind}.npz"}
            )
    errors = deepmd.driver(jobs["pb"], tmp_path)
    (tmp_path / "deepmd_job.errors.json").rename(tmp_path / "tf.errors.json")
    errors.update(deepmd_pt.driver(jobs["pth"], tmp_path))
    errors.pop("model.pb", None)  # the TensorFlow side is shown, not asserted
    assert not {k: v for k, v in errors.items() if not k.endswith("-pb.npz")}, errors
    reread = load_model(tmp_path / "model.dp")
    worst = {}
    for group, (coord, atype, box) in groups.items():
        mine = ours(model, coord, atype, box)
        pth = dict(np.load(tmp_path / f"{group}-pth.npz"))
        dp = dict(np.load(tmp_path / f"{group}-dp.npz"))
        back = ours(reread, coord, atype, box)
        for key in KEYS:
            worst[f"{group}/{key}/pth"] = rel_diff(pth[key], mine[key])
            worst[f"{group}/{key}/reread"] = rel_diff(back[key], mine[key])
        pb_file = tmp_path / f"{group}-pb.npz"
        if pb_file.exists():
            tf = rel_diff(np.load(pb_file)["energy"], mine["energy"])
            print(f"{name} {case} {group}: TensorFlow .pb energy differs by {tf:.1e}")
        worst[f"{group}/energy/dp"] = rel_diff(dp["energy"], mine["energy"])
    print(name, case, json.dumps({k: f"{v:.1e}" for k, v in worst.items()}))
    assert max(worst.values()) < 1e-10, worst


@pytest.mark.parametrize("name", list(TRAINED))
def test_mdtrain_reads_a_model_deepmd_trained(deepmd_pt, tmp_path, name):
    write_npy_system(tmp_path / "data", **water_labeled(10, seed=41))
    test = water_labeled(3, seed=42, triclinic=True)
    system = write_npy_system(tmp_path / "test", **test)
    config = deepmd_input(TRAINED[name])
    config["model"]["descriptor"] = {
        k: v for k, v in config["model"]["descriptor"].items() if v is not None
    }
    config["training"].update(numb_steps=20, disp_freq=20, save_freq=20)
    (tmp_path / "input.json").write_text(json.dumps(config, indent=1))
    deepmd_pt.dp_cmd(["--pt", "train", "input.json"], tmp_path)
    deepmd_pt.dp_cmd(["--pt", "freeze", "-o", "model.pth"], tmp_path)
    deepmd_pt.dp_cmd(["convert-backend", "model.pth", "model.dp"], tmp_path)
    dp_test = deepmd_pt.dp_cmd(["--pt", "test", "-m", "model.pth", "-s", "test"], tmp_path)
    frames_npz(tmp_path / "frames.npz", test["coords"], test["types"], test["boxes"])
    job = {"evaluate": [{"model": "model.pth", "frames": "frames.npz", "out": "pth.npz"}]}
    errors = deepmd_pt.driver(job, tmp_path)
    assert not errors, errors
    model = load_model(tmp_path / "model.dp")
    assert model.get_model_config()["descriptor"]["type"] == TRAINED[name]["type"]
    mine = ours(model, test["coords"], test["types"], test["boxes"])
    theirs = dict(np.load(tmp_path / "pth.npz"))
    worst = {key: rel_diff(mine[key], theirs[key]) for key in KEYS}
    print(name, json.dumps({k: f"{v:.1e}" for k, v in worst.items()}))
    assert max(worst.values()) < 1e-10, worst
    figures = tmp_path / "mt.json"
    assert (
        main(["test", "-m", str(tmp_path / "model.dp"), "-s", system, "--json", str(figures)]) == 0
    )
    found = json.loads(figures.read_text())["total"]
    for label, key in (("Energy RMSE", "energy_rmse"), ("Force  RMSE", "force_rmse")):
        printed = re.findall(rf"{label}\s*:\s*(\S+)", dp_test)
        assert printed, f"no {label!r} in dp test's output"
        assert found[key] == pytest.approx(float(printed[-1]), rel=1e-6), key
