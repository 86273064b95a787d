"""Single-process training: outputs, restart, init-model, neighbour-stat file, strict sel."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.train.optimizer import load_optimizer_state, make_adam
from tests.helpers.training import lcurve_rows, load_params, make_project, max_param_diff


def train(input_path, *extra: str) -> int:
    return main(["train", str(input_path), "-o", str(input_path.parent / "out"), *extra])


def test_training_writes_lcurve_checkpoints_and_resolved_input(tmp_path):
    inp = make_project(tmp_path)
    assert train(inp) == 0
    out = tmp_path / "out"
    rows = lcurve_rows(out / "lcurve.out")
    assert rows[:, 0].tolist() == [1, 2, 4, 6]
    header = (out / "lcurve.out").read_text().splitlines()[0].split()
    assert header[:3] == ["#", "step", "rmse_val"] and header[-1] == "lr"
    assert np.isfinite(rows[:, 1:]).all()
    assert set(os.listdir(out)) >= {
        "checkpoint",
        "lcurve.out",
        "model.ckpt-3.pt",
        "model.ckpt-6.pt",
    }
    assert os.path.realpath(out / "model.ckpt.pt") == str(out / "model.ckpt-6.pt")
    resolved = json.loads((out / "out.json").read_text())
    sel = resolved["model"]["descriptor"]["sel"]
    assert isinstance(sel, list) and all(s % 4 == 0 and s > 0 for s in sel)
    state = torch.load(out / "model.ckpt-6.pt", weights_only=True)
    assert state["step"] == 6 and state["model_config"]["descriptor"]["sel"] == sel


def test_restart_continues_exactly(tmp_path):
    """An interrupted and resumed run equals an uninterrupted one: parameters and lcurve rows."""
    full = make_project(tmp_path / "full")
    assert train(full) == 0
    part = make_project(tmp_path / "part")
    assert train(part) == 0
    out = part.parent / "out"
    # keep only what existed at step 3, as if the run had been killed right after that save
    os.remove(out / "model.ckpt-6.pt")
    assert train(part, "--restart", str(out / "model.ckpt-3.pt")) == 0
    diff = max_param_diff(
        load_params(out / "model.ckpt-6.pt"), load_params(full.parent / "out" / "model.ckpt-6.pt")
    )
    assert diff < 1e-12
    np.testing.assert_array_equal(
        lcurve_rows(out / "lcurve.out"), lcurve_rows(full.parent / "out" / "lcurve.out")
    )


def test_restart_auto_starts_fresh_then_resumes(tmp_path):
    inp = make_project(tmp_path, numb_steps=3)
    assert train(inp, "--restart", "auto") == 0  # nothing to resume: a fresh run
    config = json.loads(inp.read_text())
    config["training"]["numb_steps"] = 6
    inp.write_text(json.dumps(config))
    assert train(inp, "--restart", "auto") == 0
    assert torch.load(tmp_path / "out" / "model.ckpt.pt", weights_only=True)["step"] == 6
    assert lcurve_rows(tmp_path / "out" / "lcurve.out")[:, 0].tolist() == [1, 2, 4, 6]


def test_init_model_starts_from_weights_at_step_zero(tmp_path):
    inp = make_project(tmp_path, numb_steps=3)
    assert train(inp) == 0
    ckpt = tmp_path / "out" / "model.ckpt-3.pt"
    other = make_project(tmp_path / "second", numb_steps=1)
    assert train(other, "--init-model", str(ckpt)) == 0
    state = torch.load(other.parent / "out" / "model.ckpt-1.pt", weights_only=True)
    assert state["step"] == 1
    first = load_params(ckpt)
    # the descriptor statistics come from the checkpoint, not from new data statistics
    assert torch.equal(state["model_state"]["descriptor.davg"], first["descriptor.davg"])


def test_neighbor_stat_file_is_used_and_checked(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=1)
    stat = tmp_path / "ns.json"
    assert main(["neighbor-stat", str(inp), "-o", str(stat)]) == 0
    assert train(inp, "--neighbor-stat-file", str(stat)) == 0
    data = json.loads(stat.read_text())
    data["rcut"] = 5.0
    stat.write_text(json.dumps(data))
    assert train(inp, "--neighbor-stat-file", str(stat)) == 1
    assert "rcut" in capsys.readouterr().err


def test_skip_neighbor_stat_needs_list_sel(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=1)
    assert train(inp, "--skip-neighbor-stat") == 1
    assert "--skip-neighbor-stat needs a list sel" in capsys.readouterr().err


def test_strict_sel_rejects_a_small_sel(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=1, strict_sel=True)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"]["sel"] = [1, 1]
    inp.write_text(json.dumps(config))
    assert train(inp) == 1
    assert "strict_sel" in capsys.readouterr().err


@pytest.mark.parametrize("prefix", ["", "sub/"])
def test_max_ckpt_keep(tmp_path, prefix):
    inp = make_project(
        tmp_path, numb_steps=6, save_freq=1, max_ckpt_keep=2, save_ckpt=prefix + "model.ckpt"
    )
    assert train(inp) == 0
    kept = sorted(
        n for n in os.listdir(tmp_path / "out" / (prefix or ".")) if n.startswith("model.ckpt-")
    )
    assert kept == ["model.ckpt-5.pt", "model.ckpt-6.pt"]


def test_seed_null_draws_a_seed_that_repeats_the_run(tmp_path):
    """DeePMD's rule: no seed means a random one; it is recorded so that the run can be
    repeated exactly."""
    runs = []
    for name, seed in (("a", None), ("b", None), ("c", "from a")):
        inp = make_project(tmp_path / name, numb_steps=2, disp_freq=1, save_freq=2)
        config = json.loads(inp.read_text())
        config["training"]["seed"] = runs[0][0] if seed else None
        for section in ("descriptor", "fitting_net"):
            config["model"][section]["seed"] = None  # initialisation from the drawn seed too
        inp.write_text(json.dumps(config))
        assert train(inp) == 0
        drawn = json.loads((tmp_path / name / "out" / "out.json").read_text())["training"]["seed"]
        runs.append((drawn, lcurve_rows(tmp_path / name / "out" / "lcurve.out")))
    (seed_a, rows_a), (seed_b, _), (seed_c, rows_c) = runs
    assert isinstance(seed_a, int) and seed_a != seed_b
    assert seed_c == seed_a
    np.testing.assert_array_equal(rows_a, rows_c)


def test_optimizer_state_keeps_this_process_implementation():
    """The saved fused/foreach flags come from the writer's torch; the moments are restored."""
    params = [torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]
    writer = torch.optim.Adam(params, lr=1e-3, foreach=False, fused=False)
    params[0].grad = torch.full_like(params[0], 0.5)
    writer.step()
    reader = make_adam([torch.nn.Parameter(torch.ones(3, dtype=torch.float64))], 1e-3)
    flags = [(g["fused"], g["foreach"]) for g in reader.param_groups]
    load_optimizer_state(reader, writer.state_dict())
    assert [(g["fused"], g["foreach"]) for g in reader.param_groups] == flags
    saved = writer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(reader.state_dict()["state"][0]["exp_avg"], saved)
