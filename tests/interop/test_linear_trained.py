"""The combined models from input.json end to end against DeePMD-kit: ``linear_ener`` (a
type-embedding network with a pair table, and two networks) and DP+ZBL (``use_srtab``), a
short mdtrain training on a small generated water data set, ``mdtrain freeze -o model.dp``,
then ``mdtrain test -m model.dp`` and DeePMD-kit's PyTorch backend on the same file (``dp
convert-backend model.dp model.pth``, ``dp --pt test -m model.pth``): the same energy, force
and virial RMSEs, and per-frame predictions (``-d`` detail files) equal to 1e-10. DeePMD-kit
3.2 builds these models only around type-mixed descriptors (se_atten and its kin). Needs
``MDTRAIN_DEEPMD_PT_PYTHON`` (the ``deepmd_pt`` fixture; skipped without it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.descriptor_battery import battery_config
from tests.helpers.pair_tables import write_table, zbl_table
from tests.helpers.training import make_project, mdtrain_and_dp_test

pytestmark = pytest.mark.interop


def network(name: str, seed: int) -> dict:
    desc = battery_config(name)["descriptor"] | {"sel": "auto", "seed": seed}
    return {"descriptor": desc, "fitting_net": {"neuron": [16, 16], "seed": seed}}


def model_section(kind: str) -> dict:
    table = {"type": "pairtab", "tab_file": "tab.txt", "rcut": 4.5, "sel": "auto"}
    type_map = ["O", "H"]
    if kind == "net+table":
        return {"type": "linear_ener", "type_map": type_map, "weights": "sum",
                "models": [network("se_atten", 1), table]}  # fmt: skip
    if kind == "two nets":
        return {"type": "linear_ener", "type_map": type_map, "weights": [0.3, 0.7],
                "models": [network("se_atten", 1), network("se_atten_v2", 2)]}  # fmt: skip
    return {"type_map": type_map, **network("se_atten_v2", 1), "use_srtab": "tab.txt",
            "smin_alpha": 0.1, "sw_rmin": 0.8, "sw_rmax": 1.0}  # fmt: skip


@pytest.mark.parametrize("kind", ["net+table", "two nets", "zbl"])
def test_mdtrain_trained_combined_model_gives_deepmds_test_errors(deepmd_pt, tmp_path, kind):
    inp = make_project(tmp_path)
    write_table(tmp_path / "tab.txt", zbl_table(["O", "H"], 0.1, 4.5, 0.01, zero_from=4.0))
    config = json.loads(inp.read_text())
    config["model"] = model_section(kind) | {"data_stat_nbatch": 2}
    config["training"]["numb_steps"] = 4
    inp.write_text(json.dumps(config))
    shown = mdtrain_and_dp_test(deepmd_pt, inp, detail=True)
    largest = {}
    for part in ("e", "f", "v"):
        ours, theirs = (np.loadtxt(tmp_path / f"{who}.{part}.out") for who in ("md", "dp"))
        largest[part] = float(np.abs(ours - theirs).max())
        np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-10)
    print(kind, json.dumps({k: f"mdtrain {a:.6e} deepmd {b:.6e}" for k, (a, b) in shown.items()}))
    print(kind, "largest detail-file differences", largest)
    for key, (ours, theirs) in shown.items():
        assert ours == pytest.approx(theirs, rel=1e-6), key
