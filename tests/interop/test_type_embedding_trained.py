"""The type-embedding descriptors (se_atten, se_atten_v2, se_e3_tebd) end to end against
DeePMD-kit: a short mdtrain training on a small generated water data set, ``mdtrain freeze -o
model.dp``, then ``mdtrain test -m model.dp`` and DeePMD-kit's PyTorch backend on the same
file (``dp convert-backend model.dp model.pth``, ``dp --pt test -m model.pth``): the same
energy, force and virial RMSEs (to the 7 digits ``dp test`` prints). Needs
``MDTRAIN_DEEPMD_PT_PYTHON`` (the ``deepmd_pt`` fixture; skipped without it).
"""

from __future__ import annotations

import json
import re

import pytest

from mdtrain.cli import main
from tests.helpers.datagen import water_labeled, write_npy_system
from tests.helpers.descriptor_battery import battery_config
from tests.helpers.training import make_project

pytestmark = pytest.mark.interop

NAMES = ("se_atten", "se_atten_v2", "se_e3_tebd")
PRINTED = (
    ("Energy RMSE", "energy_rmse"),
    ("Force  RMSE", "force_rmse"),
    ("Virial RMSE", "virial_rmse"),
)


@pytest.mark.parametrize("name", NAMES)
def test_mdtrain_trained_model_dp_gives_deepmds_test_errors(deepmd_pt, tmp_path, name):
    inp = make_project(tmp_path)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"] = battery_config(name)["descriptor"] | {"sel": "auto"}
    config["training"]["numb_steps"] = 6
    inp.write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["train", str(inp), "-o", str(out)]) == 0
    model_dp = tmp_path / "model.dp"
    assert main(["freeze", str(out / "model.ckpt.pt"), "-o", str(model_dp)]) == 0
    system = write_npy_system(tmp_path / "test", **water_labeled(3, 6, 6.0, seed=42))
    figures = tmp_path / "mt.json"
    assert main(["test", "-m", str(model_dp), "-s", system, "--json", str(figures)]) == 0
    found = json.loads(figures.read_text())["total"]
    deepmd_pt.dp_cmd(["convert-backend", "model.dp", "model.pth"], tmp_path)
    dp_test = deepmd_pt.dp_cmd(["--pt", "test", "-m", "model.pth", "-s", "test"], tmp_path)
    shown = {}
    for label, key in PRINTED:
        printed = re.findall(rf"{label}\s*:\s*(\S+)", dp_test)
        assert printed, f"no {label!r} in dp test's output"
        shown[key] = (found[key], float(printed[-1]))
    print(name, json.dumps({k: f"mdtrain {a:.6e} deepmd {b:.6e}" for k, (a, b) in shown.items()}))
    for key, (ours, theirs) in shown.items():
        assert ours == pytest.approx(theirs, rel=1e-6), key
