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


_READ_BIAS = """
import json, sys, torch
state = torch.load(sys.argv[1], weights_only=False, map_location="cpu")["model"]
key = "model.Default.atomic_model."
print(json.dumps({
    "bias": state[key + "out_bias"].flatten().tolist(),
    "part_bias": [state[key + f"models.{k}.out_bias"].abs().max().item() for k in (0, 1)],
    "dstd": state[key + "models.0.descriptor.se_atten.stddev"].flatten().tolist(),
}))
"""


def test_statistics_equal_deepmds_linear_model(deepmd_pt, tmp_path):
    """``dp --pt train`` (one step) and mdtrain's statistics of the same linear model on all
    frames: the sum's energy bias (the labels alone), the parts' bias 0, the network's dstd."""
    import torch

    from mdtrain.config import load_config
    from mdtrain.data import open_all
    from mdtrain.model.backend import build_model
    from mdtrain.model.stats import compute_or_load_stats

    inp = make_project(tmp_path, numb_steps=1, save_freq=1, disp_freq=1)
    write_table(tmp_path / "tab.txt", zbl_table(["O", "H"], 0.1, 4.5, 0.01, zero_from=4.0))
    config = json.loads(inp.read_text())
    model = model_section("net+table") | {"data_stat_nbatch": 4}  # 4 x 2 frames: all of them
    model["models"][0]["descriptor"]["sel"] = 40
    model["models"][1]["sel"] = 40
    config["model"] = model
    inp.write_text(json.dumps(config))
    deepmd_pt.dp_cmd(["--pt", "train", "input.json"], tmp_path)
    read = deepmd_pt.run([deepmd_pt.python, "-c", _READ_BIAS, "model.ckpt-1.pt"], tmp_path)
    theirs = json.loads(read.strip().splitlines()[-1])
    loaded = load_config(inp)
    paths = [str(tmp_path / "data" / n) for n in ("train_a", "train_b")]
    ours = build_model(loaded["model"])
    compute_or_load_stats(ours, open_all(paths, ["O", "H"]), None, 4)
    print("energy bias: mdtrain", ours.out_bias.tolist(), "deepmd", theirs["bias"])
    np.testing.assert_allclose(ours.out_bias.numpy(), theirs["bias"], rtol=1e-12)
    assert theirs["part_bias"] == [0.0, 0.0]
    assert torch.count_nonzero(ours.parts[0].out_bias) == 0
    dstd = ours.parts[0].descriptor.dstd.numpy().ravel()
    np.testing.assert_allclose(dstd, theirs["dstd"], rtol=1e-12)
