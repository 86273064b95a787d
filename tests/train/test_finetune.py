"""``--finetune`` and ``--init-model`` with mdtrain checkpoints and ``.dp`` files: a model trained
on the water project, fine-tuned on a copy of its data with the type_map reversed, keeps every
net and statistic under the new type indices, its forces unchanged, and its energy bias refitted
to the least-squares correction of the new data; new elements get fresh nets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from mdtrain.model.files import load_model_file
from mdtrain.train.finetune import finetune_config
from tests.helpers.finetune import (
    assert_same_runs_from_checkpoint_and_dp,
    finetuned,
    frames,
    reversed_copy,
    train,
)
from tests.helpers.models import evaluate
from tests.helpers.training import make_project


@pytest.fixture(scope="module", params=[True, False], ids=["one_side", "two_side"])
def pretrained(request, tmp_path_factory) -> Path:
    """A checkpoint trained a few steps on the water project (O, H)."""
    root = tmp_path_factory.mktemp("pretrained")
    inp = make_project(root, numb_steps=4)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"]["type_one_side"] = request.param
    config["model"]["data_stat_nbatch"] = 100  # every frame: the bias fit below uses them all
    inp.write_text(json.dumps(config))
    assert train(inp) == 0
    return root / "out" / "model.ckpt.pt"


def test_reversed_type_map_keeps_the_model(pretrained, tmp_path):
    """Same forces on the same atoms; energies shifted by N·δ with δ the minimum-norm
    least-squares fit of label − prediction over the new data (computed here with numpy)."""
    inp = reversed_copy(pretrained.parent.parent, tmp_path, ["H", "O"])
    model, pre, systems = finetuned(inp, pretrained)
    old = load_model(pretrained)
    old_state, new_state = pre["model_state"], model.state_dict()
    for t_new, t_old in ((0, 1), (1, 0)):
        for key in [k for k in new_state if k.startswith(f"fitting.networks.{t_new}.")]:
            old_key = f"fitting.networks.{t_old}." + key.split(".", 3)[3]
            assert torch.equal(new_state[key], old_state[old_key]), key
    rows, residuals, predicted_old = [], [], []
    for system in systems:
        for coord, box, atype, label in frames(system):
            new_out = evaluate(model, coord, box, atype)
            old_out = evaluate(old, coord, box, 1 - atype)  # the same atoms, old indices
            np.testing.assert_allclose(new_out["force"], old_out["force"], rtol=0, atol=1e-12)
            np.testing.assert_allclose(new_out["virial"], old_out["virial"], rtol=0, atol=1e-11)
            rows.append(np.bincount(atype, minlength=2).astype(float))
            residuals.append(label - float(old_out["energy"]))
            predicted_old.append(float(old_out["energy"]))
    delta = np.linalg.lstsq(np.array(rows), np.array(residuals), rcond=None)[0]
    expected_bias = old_state["out_bias"].numpy()[[1, 0]] + delta
    np.testing.assert_allclose(model.out_bias.numpy(), expected_bias, rtol=1e-9, atol=1e-9)
    # the refit lowers the energy error on the new data
    new_err = [
        label - float(evaluate(model, c, b, a)["energy"])
        for s in systems
        for c, b, a, label in frames(s)
    ]
    assert np.sqrt(np.mean(np.square(new_err))) <= np.sqrt(np.mean(np.square(residuals))) + 1e-9


def test_new_element_gets_fresh_nets(pretrained, tmp_path):
    inp = reversed_copy(pretrained.parent.parent, tmp_path, ["H", "C", "O"])
    model, pre, _ = finetuned(inp, pretrained)
    old_state, state = pre["model_state"], model.state_dict()
    assert model.type_map == ["H", "C", "O"]
    old_sel = pre["model_config"]["descriptor"]["sel"]
    assert [model.sel[0], model.sel[2]] == [old_sel[1], old_sel[0]]
    assert torch.equal(
        state["fitting.networks.2.layers.0.weight"], old_state["fitting.networks.0.layers.0.weight"]
    )
    assert not torch.equal(
        state["fitting.networks.1.layers.0.weight"][
            : old_state["fitting.networks.0.layers.0.weight"].shape[0]
        ],
        old_state["fitting.networks.0.layers.0.weight"],
    )
    davg_o = state["descriptor.davg"][2, 0, 0]
    assert float(davg_o) == float(old_state["descriptor.davg"][0, 0, 0])
    if not model.descriptor.type_one_side:  # (centre O=2, neighbour H=0) <- (O=0, H=1)
        ntypes, old_n = 3, 2
        new_key = f"descriptor.networks.{2 + 0 * ntypes}.layers.0.weight"
        old_key = f"descriptor.networks.{0 + 1 * old_n}.layers.0.weight"
        assert torch.equal(state[new_key], old_state[old_key])


def test_finetune_runs_from_checkpoint_and_dp(pretrained, tmp_path):
    """Two steps from the checkpoint and from its ``.dp`` file: the same run."""
    assert_same_runs_from_checkpoint_and_dp(pretrained, tmp_path)


def test_init_model_from_dp_equals_checkpoint(pretrained, tmp_path):
    dp = tmp_path / "pretrained.dp"
    assert main(["freeze", str(pretrained), "-o", str(dp)]) == 0
    for source in (pretrained, dp):
        run = tmp_path / source.suffix.strip(".")
        shutil.copytree(pretrained.parent.parent / "data", run / "data")
        config = json.loads((pretrained.parent.parent / "input.json").read_text())
        config["training"]["numb_steps"] = 1
        (run / "input.json").write_text(json.dumps(config))
        assert train(run / "input.json", "--init-model", str(source)) == 0
    a = torch.load(tmp_path / "pt" / "out" / "model.ckpt.pt", weights_only=True)["model_state"]
    b = torch.load(tmp_path / "dp" / "out" / "model.ckpt.pt", weights_only=True)["model_state"]
    for key in a:
        if key != "out_std":  # a .dp carries no out_std (unused by energy models)
            assert torch.equal(a[key], b[key]), key


def test_finetune_errors(pretrained, tmp_path, capsys):
    inp = reversed_copy(pretrained.parent.parent, tmp_path, ["H", "O"])
    assert train(inp, "--finetune", str(pretrained), "--init-model", str(pretrained)) == 1
    assert "--init-model and --finetune exclude each other" in capsys.readouterr().err
    pre = load_model_file(pretrained)
    config = json.loads(inp.read_text())
    config["model"]["type_map"] = ["Cu", "Au"]
    with pytest.raises(MDTrainError, match="no element of the input's type_map"):
        finetune_config(config, pre, str(pretrained))


def test_checkpoint_and_dp_carry_min_nbor_dist(pretrained, tmp_path):
    """The data's smallest distance (what ``neighbor-stat`` reports) reaches the checkpoint and
    the DeePMD-kit file's ``min_nbor_dist``."""
    from mdtrain.model.deepmd_file import load_dp

    stat = tmp_path / "ns.json"
    assert (
        main(["neighbor-stat", str(pretrained.parent.parent / "input.json"), "-o", str(stat)]) == 0
    )
    expected = json.loads(stat.read_text())["min_nbor_dist"]
    state = torch.load(pretrained, weights_only=True)
    assert state["min_nbor_dist"] == pytest.approx(expected, rel=1e-12)
    dp = tmp_path / "m.dp"
    assert main(["freeze", str(pretrained), "-o", str(dp)]) == 0
    assert load_dp(dp)["min_nbor_dist"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tebd_dim", [3, 2, 4], ids=["no_skip", "skip", "double_skip"])
def test_type_mixed_descriptor_keeps_its_one_fitting_net(tmp_path, tebd_dim):
    """se_atten: one fitting net for all types (DeePMD-kit's rule), kept whole; the
    reversed type_map gives the same forces on the same atoms, also where the type
    embedding's first layer adds its one-hot input (tebd_dim 2 or 4 for two types)."""
    from tests.helpers.descriptor_battery import battery_config

    inp = make_project(tmp_path / "pre", numb_steps=2)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"] = {
        **battery_config("se_atten")["descriptor"],
        "tebd_dim": tebd_dim,
    }
    inp.write_text(json.dumps(config))
    assert train(inp) == 0
    source = inp.parent / "out" / "model.ckpt.pt"
    model, pre, systems = finetuned(reversed_copy(inp.parent, tmp_path / "new", ["H", "O"]), source)
    assert len(model.fitting.networks) == 1
    old_state, state = pre["model_state"], model.state_dict()
    for key in [k for k in state if k.startswith("fitting.networks.0.")]:
        assert torch.equal(state[key], old_state[key]), key
    old = load_model(source)
    coord, box, atype, _ = frames(systems[0])[0]
    new_out, old_out = evaluate(model, coord, box, atype), evaluate(old, coord, box, 1 - atype)
    np.testing.assert_allclose(new_out["force"], old_out["force"], rtol=0, atol=1e-12)
