"""``--finetune`` of a hybrid descriptor and of combined models (``linear_ener`` with a pair
table, DP+ZBL): with the same type_map the model starts as the pretrained one (forces bit
for bit, energies shifted by the refitted bias); under a reordered type_map, or one that
drops an element, each hybrid member and each part keeps its weights, sel and statistics
under the new indices and a table its columns (the same forces on the same atoms); an added
element gets fresh nets, or, for a table without it, a one-line error naming the pair and
the file; and a short run trains from a checkpoint and from a ``.dp`` file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mdtrain.config import load_config
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from mdtrain.model.files import load_model_file
from mdtrain.train.finetune import finetune_config
from tests.helpers.finetune import (
    assert_same_model_refitted,
    assert_same_runs_from_checkpoint_and_dp,
    finetuned,
    reversed_copy,
    train,
)
from tests.helpers.pair_tables import linear_input, write_table, zbl_table
from tests.helpers.training import make_project

HYBRID = {
    "type": "hybrid",
    "list": [
        {"type": "se_e2_a", "sel": [8, 28, 0], "rcut": 2.5, "rcut_smth": 0.4, "neuron": [4, 8],
         "axis_neuron": 4, "resnet_dt": True, "seed": 1},
        {"type": "se_e2_r", "sel": [16, 24, 0], "rcut": 3.5, "rcut_smth": 0.5, "neuron": [3, 6],
         "type_one_side": True, "seed": 2},
    ],
}  # fmt: skip


def _pretrain(root: Path, edit) -> Path:
    """A checkpoint of the water project trained 3 steps, its input changed by ``edit``;
    every frame sampled for the statistics (the refit below uses them all)."""
    inp = make_project(root, numb_steps=3)
    config = json.loads(inp.read_text())
    edit(config, root)
    config["model"]["data_stat_nbatch"] = 100
    inp.write_text(json.dumps(config))
    assert train(inp) == 0
    return root / "out" / "model.ckpt.pt"


def _hybrid(config: dict, root: Path) -> None:
    config["model"]["type_map"] = ["O", "H", "C"]  # C: no neighbours (sel 0), none in the data
    config["model"]["descriptor"] = json.loads(json.dumps(HYBRID))


def _se_e3(config: dict, root: Path) -> None:
    config["model"]["descriptor"] = {"type": "se_e3", "sel": [8, 16], "rcut": 3.0,
                                     "rcut_smth": 0.5, "neuron": [2, 4], "seed": 1}  # fmt: skip


def _linear(config: dict, root: Path) -> None:
    linear = json.loads(linear_input(root / "linear", sel=[20, 40]).read_text())
    (root / "d3.txt").write_bytes((root / "linear" / "d3.txt").read_bytes())
    config["model"] = {**linear["model"], "data_stat_nbatch": 100}


def _zbl(config: dict, root: Path) -> None:
    write_table(root / "zbl.txt", zbl_table(["O", "H"], 0.1, 4.0, 0.01, zero_from=3.5))
    config["model"].update(use_srtab="zbl.txt", smin_alpha=0.1, sw_rmin=0.8, sw_rmax=1.0)


@pytest.fixture(scope="module", params=["hybrid", "se_e3", "linear", "zbl"])
def pretrained(request, tmp_path_factory) -> Path:
    edit = {"hybrid": _hybrid, "se_e3": _se_e3, "linear": _linear, "zbl": _zbl}[request.param]
    return _pretrain(tmp_path_factory.mktemp(request.param), edit)


def _same_copy(pretrained: Path, dst: Path) -> Path:
    """The pretrained project's input under its own type_map, in ``dst``."""
    inp = reversed_copy(pretrained.parent.parent, dst, ["H", "O"])
    config = json.loads(inp.read_text())
    config["model"]["type_map"] = load_model_file(pretrained)["model_config"]["type_map"]
    inp.write_text(json.dumps(config))
    return inp


def test_same_type_map_starts_as_the_pretrained_model(pretrained, tmp_path):
    """Every weight and statistic the pretrained one; forces bit for bit; the bias refitted."""
    inp = _same_copy(pretrained, tmp_path)
    model, pre, systems = finetuned(inp, pretrained)
    old_map = pre["model_config"]["type_map"]
    assert model.type_map == old_map
    state, old_state = model.state_dict(), pre["model_state"]
    assert state.keys() == old_state.keys()
    for key in state:
        if not key.endswith("out_bias"):
            assert torch.equal(state[key], old_state[key].to(state[key].dtype)), key
    assert_same_model_refitted(
        model, load_model(pretrained), systems, np.arange(len(old_map)),
        old_state["out_bias"].numpy(), atol=0.0,
    )  # fmt: skip


def test_reordered_type_map_keeps_the_model(pretrained, tmp_path):
    """H and O swapped (and the hybrid's C dropped): the same forces on the same atoms."""
    inp = reversed_copy(pretrained.parent.parent, tmp_path, ["H", "O"])
    model, pre, systems = finetuned(inp, pretrained)
    old_map = pre["model_config"]["type_map"]
    old_types = np.array([old_map.index(t) for t in model.type_map])
    old_bias = pre["model_state"]["out_bias"].numpy()[old_types]
    assert_same_model_refitted(model, load_model(pretrained), systems, old_types, old_bias)
    new_cfg, old_cfg = model.get_model_config(), pre["model_config"]
    if "list" in old_cfg.get("descriptor", {}):  # each member its own sel, in the new order
        for member, old in zip(new_cfg["descriptor"]["list"], old_cfg["descriptor"]["list"]):
            assert member["sel"] == [old["sel"][1], old["sel"][0]]
    for part, old in zip(new_cfg.get("models", []), old_cfg.get("models", [])):
        if part.get("type") == "pairtab":  # O-O, O-H, H-H -> H-H, H-O, O-O
            rows = np.asarray(old["table_rows"])
            np.testing.assert_array_equal(np.asarray(part["table_rows"]), rows[:, [0, 3, 2, 1]])


def test_added_element(pretrained, tmp_path):
    """A network's new element gets fresh nets and the known ones theirs; a table without
    a column for it is refused in one line naming the pair and the file."""
    inp = reversed_copy(pretrained.parent.parent, tmp_path, ["H", "C", "O"])
    pre = load_model_file(pretrained)
    kind = pre["model_config"].get("descriptor", {}).get("type")
    if kind == "se_e3":  # one net per unordered pair of neighbour types
        inp = reversed_copy(pretrained.parent.parent, tmp_path / "n", ["H", "N", "O"])
        model, pre, _ = finetuned(inp, pretrained)
        state, old_state = model.state_dict(), pre["model_state"]
        net = "descriptor.networks.{}.layers.0.weight"
        # new pairs (0,0) (0,1) (1,1) (0,2) (1,2) (2,2), old (0,0) (0,1) (1,1); H=0 N=1 O=2
        for new, old in ((0, 2), (3, 1), (5, 0)):  # H-H, H-O, O-O
            assert torch.equal(state[net.format(new)], old_state[net.format(old)])
        return
    if kind != "hybrid":
        key = "models[1].tab_file" if "models" in pre["model_config"] else "use_srtab"
        table = "d3.txt" if "models" in pre["model_config"] else "zbl.txt"
        with pytest.raises(MDTrainError) as err:
            finetune_config(load_config(str(inp)), pre, str(pretrained))
        message = str(err.value)
        assert "\n" not in message
        assert f"model.{key}" in message and table in message
        assert "no column for the pair H-C (C is not in the table's type_map" in message
        return
    inp = reversed_copy(pretrained.parent.parent, tmp_path / "n", ["H", "N", "O"])
    model, pre, _ = finetuned(inp, pretrained)
    state, old_state = model.state_dict(), pre["model_state"]
    a, r = "descriptor.members.0.", "descriptor.members.1."
    # se_e2_a (one net per centre, neighbour pair c + t·ntypes): (O=2, H=0) <- (O=0, H=1)
    weight = "layers.0.weight"
    assert torch.equal(state[f"{a}networks.2.{weight}"], old_state[f"{a}networks.3.{weight}"])
    # se_e2_r, type_one_side (one net per neighbour type): H=0 <- H=1, O=2 <- O=0
    assert torch.equal(state[f"{r}networks.0.{weight}"], old_state[f"{r}networks.1.{weight}"])
    assert torch.equal(state[f"{r}networks.2.{weight}"], old_state[f"{r}networks.0.{weight}"])
    fresh = state[f"{r}networks.1.{weight}"]
    assert not any(torch.equal(fresh, old_state[f"{r}networks.{t}.{weight}"]) for t in range(3))
    for k, member in enumerate(model.descriptor.members):
        old_sel = pre["model_config"]["descriptor"]["list"][k]["sel"]
        assert [member.sel[0], member.sel[2]] == [old_sel[1], old_sel[0]]
        # davg of centre O, neighbour block H: the pretrained (O, H) block's value
        old_davg = old_state[f"descriptor.members.{k}.davg"]
        h_block = slice(0, member.sel[0])
        expected = old_davg[0, old_sel[0]].expand_as(member.davg[2, h_block])
        assert torch.equal(member.davg[2, h_block], expected)


def test_short_runs_from_checkpoint_and_dp(pretrained, tmp_path):
    """Two steps from the checkpoint and from its ``.dp`` file: the same run."""
    assert_same_runs_from_checkpoint_and_dp(pretrained, tmp_path)


def test_another_kind_of_model_is_refused_in_one_line(tmp_path):
    config = load_config(linear_input(tmp_path, sel=[20, 40]))
    standard = {**config["model"]["models"][0], "type_map": ["O", "H"]}
    with pytest.raises(
        MDTrainError,
        match=r"^--finetune p: the pretrained model is a standard model, the input's a "
        r"linear_ener \[standard, pairtab\] model \(",
    ):
        finetune_config(config, {"model_config": standard}, "p")
