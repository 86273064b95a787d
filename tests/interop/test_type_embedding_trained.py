"""The type-embedding descriptors (se_atten, se_atten_v2, se_e3_tebd, and hybrids holding
them beside per-type members) end to end against
DeePMD-kit: a short mdtrain training on a small generated water data set, ``mdtrain freeze -o
model.dp``, then ``mdtrain test -m model.dp`` and DeePMD-kit's PyTorch backend on the same
file (``dp convert-backend model.dp model.pth``, ``dp --pt test -m model.pth``): the same
energy, force and virial RMSEs (to the 7 digits ``dp test`` prints). Needs
``MDTRAIN_DEEPMD_PT_PYTHON`` (the ``deepmd_pt`` fixture; skipped without it).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.descriptor_battery import battery_config, case_id
from tests.helpers.training import make_project, mdtrain_and_dp_test

pytestmark = pytest.mark.interop

CASES = [
    ("se_atten", {}),
    ("se_atten_v2", {}),
    ("se_e3_tebd", {}),
    ("hybrid", {"members": "mixed"}),
    ("hybrid", {"members": "mixed-tebd"}),
]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_mdtrain_trained_model_dp_gives_deepmds_test_errors(deepmd_pt, tmp_path, case):
    name = case_id(case)
    inp = make_project(tmp_path)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"] = battery_config(*case, sel="auto")["descriptor"]
    config["training"]["numb_steps"] = 6
    inp.write_text(json.dumps(config))
    shown = mdtrain_and_dp_test(deepmd_pt, inp)
    print(name, json.dumps({k: f"mdtrain {a:.6e} deepmd {b:.6e}" for k, (a, b) in shown.items()}))
    for key, (ours, theirs) in shown.items():
        assert ours == pytest.approx(theirs, rel=1e-6), key
