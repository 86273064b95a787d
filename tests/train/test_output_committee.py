"""Committees of DOS and property models (``mdtrain train --ensemble 2``): the members share
the descriptor and output statistics, start from different weights, and each is tested like a
single model; ``model-devi`` (a deviation of forces, energies and virials) refuses them in one
line."""

from __future__ import annotations

import json

import pytest
import torch

from mdtrain.cli import main
from mdtrain.errors import MDTrainError
from mdtrain.infer.committee import load_committee
from mdtrain.infer.load import load_model
from tests.helpers.output_data import make_output_project
from tests.helpers.training import load_params, max_param_diff


@pytest.mark.parametrize("kind", ["dos", "property"])
def test_committee_trains_and_model_devi_refuses(tmp_path, monkeypatch, kind):
    inp = make_output_project(tmp_path, kind, numb_steps=2)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "ens", "--ensemble", "2"]) == 0
    a, b = (load_model(tmp_path / "ens" / f"member-{k}" / "model.ckpt.pt") for k in (0, 1))
    assert torch.equal(a.out_bias, b.out_bias) and torch.equal(a.out_std, b.out_std)
    assert torch.equal(a.descriptor.davg, b.descriptor.davg)
    wa, wb = a.fitting.networks[0].layers[0].weight, b.fitting.networks[0].layers[0].weight
    assert not torch.equal(wa, wb)
    for k in (0, 1):
        assert main(["test", "-m", f"ens/member-{k}/model.ckpt.pt", "-s", "data/valid"]) == 0
    with pytest.raises(MDTrainError, match=f"a {kind} model has no energies or forces"):
        load_committee(["ens"])


def test_property_rmse_members_equal_single_runs(tmp_path, monkeypatch):
    """``rmse`` in a committee of 2 (one forward for both): each member gets its own global
    batch sums, so member k equals the single run with the seeds + k (float64)."""
    inp = make_output_project(tmp_path, "property", numb_steps=2)
    config = json.loads(inp.read_text())
    config["loss"]["loss_func"] = "rmse"
    config["training"]["save_freq"] = 2
    inp.write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "ens", "--ensemble", "2"]) == 0
    for k in (0, 1):
        single = json.loads(inp.read_text())
        for section in ("descriptor", "fitting_net"):
            single["model"][section]["seed"] += k
        (tmp_path / f"single_{k}.json").write_text(json.dumps(single))
        assert main(["train", f"single_{k}.json", "-o", f"single_{k}"]) == 0
        member = load_params(tmp_path / "ens" / f"member-{k}" / "model.ckpt-2.pt")
        alone = load_params(tmp_path / f"single_{k}" / "model.ckpt-2.pt")
        assert max_param_diff(member, alone) < 1e-10
