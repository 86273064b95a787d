"""A ``linear_ener`` model (a network and a pair table) from input.json: its statistics are
DeePMD-kit's linear model's (each network part's descriptor statistics its own, one energy
bias for the sum fitted to the labels, the parts' own biases 0), and it trains, freezes to
``.dp`` and tests like an energy model."""

from __future__ import annotations

import json

import numpy as np
import torch

from mdtrain.cli import main
from mdtrain.config import load_config
from mdtrain.data import open_all
from mdtrain.model.backend import build_model
from mdtrain.model.stats import compute_or_load_stats
from tests.helpers.pair_tables import linear_input, write_table, zbl_table
from tests.helpers.training import frozen_reports, load_params, max_param_diff


def test_statistics_are_the_networks_own_and_one_bias_for_the_sum(tmp_path):
    config = load_config(linear_input(tmp_path, sel=[20, 40]))
    systems = open_all(
        [str(tmp_path / "data" / n) for n in ("train_a", "train_b")], config["model"]["type_map"]
    )
    linear = build_model(config["model"])
    compute_or_load_stats(linear, systems, None, 2)
    alone = build_model({**config["model"]["models"][0], "data_stat_nbatch": 2,
                         "type_map": config["model"]["type_map"]})  # fmt: skip
    compute_or_load_stats(alone, systems, None, 2)
    net = linear.parts[0]
    assert torch.equal(net.descriptor.davg, alone.descriptor.davg)
    assert torch.equal(net.descriptor.dstd, alone.descriptor.dstd)
    assert not torch.equal(alone.descriptor.dstd, torch.ones_like(alone.descriptor.dstd))
    # the sum's bias is the network's would-be bias: the labels alone, the table not subtracted
    torch.testing.assert_close(linear.out_bias, alone.out_bias, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(net.out_bias) == 0
    # DeePMD-kit's sample: data_stat_nbatch batches of ceil(32 / natoms) frames per system
    taken = [2 * -(-32 // s.natoms) for s in systems]
    counts = np.concatenate(
        [np.tile(np.bincount(s.atype, minlength=2), (n, 1)) for s, n in zip(systems, taken)]
    )
    energy = np.concatenate([s.frames(np.arange(n))["energy"] for s, n in zip(systems, taken)])
    expected = np.linalg.lstsq(counts.astype(float), energy, rcond=None)[0]
    np.testing.assert_allclose(linear.out_bias.numpy(), expected, rtol=1e-10)


def test_linear_model_trains_freezes_and_tests(tmp_path):
    path = linear_input(tmp_path)
    reports = frozen_reports(path, removed=tmp_path / "d3.txt")  # both keep their table
    assert reports["ckpt"] == reports["dp"] and reports["dp"]
    stored = json.loads((tmp_path / "out" / "out.json").read_text())["model"]
    assert isinstance(stored["models"][0]["descriptor"]["sel"], list)  # "auto", resolved
    assert isinstance(stored["models"][1]["sel"], int)  # all types together


def test_linear_model_restarts_exactly_and_starts_from_a_checkpoint(tmp_path):
    """--restart continues a linear model as if never stopped; --init-model starts from its
    weights and table (its checkpoint's table, as DeePMD-kit keeps tables in its state)."""
    path = linear_input(tmp_path, sel=[20, 40], numb_steps=4)
    config = json.loads(path.read_text())
    config["training"]["save_freq"] = 2
    path.write_text(json.dumps(config))
    assert main(["train", str(path), "-o", str(tmp_path / "whole")]) == 0
    middle = str(tmp_path / "whole" / "model.ckpt-2.pt")
    assert main(["train", str(path), "-o", str(tmp_path / "cont"), "--restart", middle]) == 0
    whole = load_params(tmp_path / "whole" / "model.ckpt.pt")
    assert max_param_diff(whole, load_params(tmp_path / "cont" / "model.ckpt.pt")) == 0.0
    # --init-model with a learning rate too small to move the weights: they stay the
    # checkpoint's, and the table is the checkpoint's even where the input names another
    config["learning_rate"] = {"type": "exp", "start_lr": 1e-30, "stop_lr": 1e-31}
    config["training"]["numb_steps"] = 1
    config["model"]["models"][1]["tab_file"] = "other.txt"
    write_table(tmp_path / "other.txt", 2 * zbl_table(["O", "H"], 0.1, 4.5, 0.01, zero_from=4.0))
    path.write_text(json.dumps(config))
    start = str(tmp_path / "whole" / "model.ckpt.pt")
    assert main(["train", str(path), "-o", str(tmp_path / "init"), "--init-model", start]) == 0
    assert max_param_diff(whole, load_params(tmp_path / "init" / "model.ckpt.pt")) < 1e-20
    stored = json.loads((tmp_path / "init" / "out.json").read_text())["model"]["models"][1]
    assert stored["tab_file"] == str((tmp_path / "d3.txt").resolve())


def test_linear_committee_trains_and_gives_model_deviations(tmp_path):
    path = linear_input(tmp_path, sel=[20, 40], numb_steps=2)
    out = tmp_path / "committee"
    assert main(["train", str(path), "-o", str(out), "--ensemble", "2"]) == 0
    members = [load_params(out / f"member-{k}" / "model.ckpt.pt") for k in (0, 1)]
    assert max_param_diff(*members) > 1e-3  # seeds of each network part differ by member
    devi = tmp_path / "devi.out"
    system = str(tmp_path / "data" / "valid")
    assert main(["model-devi", "-m", str(out), "-s", system, "-o", str(devi)]) == 0
    rows = np.loadtxt(devi, ndmin=2)
    assert rows.shape[0] == 4 and np.all(rows[:, 4] > 0)  # max_devi_f of each frame
