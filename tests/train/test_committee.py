"""Committee training (``--ensemble``, ``training.ensemble``): member k equals a single run
with the model seeds + k (or, from one model's weights, the training seed + k), restarts are
exact, and every member is a model freeze and test take. All float64, one process."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import mdtrain.distributed.runtime as runtime_module
from mdtrain import memory
from mdtrain.cli import main
from tests.helpers.placement import OTHER, OtherDevice
from tests.helpers.training import lcurve_rows, load_params, make_project, max_param_diff

TOL = 1e-10


def train(input_path, out, *extra: str) -> int:
    return main(["train", str(input_path), "-o", str(out), *extra])


def with_changes(input_path, name: str, model_seed: int = 0, training_seed: int = 0, **training):
    """A copy of the input with the model seeds and the training seed increased."""
    config = json.loads(input_path.read_text())
    for section in ("descriptor", "fitting_net"):
        config["model"][section]["seed"] += model_seed
    config["training"]["seed"] += training_seed
    config["training"].update(training)
    path = input_path.parent / name
    path.write_text(json.dumps(config))
    return path


def assert_same_run(member_dir, single_dir, step: int) -> None:
    a, b = lcurve_rows(member_dir / "lcurve.out"), lcurve_rows(single_dir / "lcurve.out")
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
    name = f"model.ckpt-{step}.pt"
    assert max_param_diff(load_params(member_dir / name), load_params(single_dir / name)) < TOL


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_members_equal_single_runs_with_seeds_plus_k(tmp_path, monkeypatch, backend):
    monkeypatch.setenv("MDTRAIN_BACKEND", backend)
    inp = make_project(tmp_path, numb_steps=4, save_freq=2)
    assert train(inp, tmp_path / "committee", "--ensemble", "2") == 0
    out = tmp_path / "committee"
    for k in (0, 1):
        single = with_changes(inp, f"single_{k}.json", model_seed=k)
        assert train(single, tmp_path / f"single_{k}") == 0
        assert_same_run(out / f"member-{k}", tmp_path / f"single_{k}", 4)
    # the members really differ (the comparison above is not vacuous)
    a = load_params(out / "member-0" / "model.ckpt-4.pt")
    assert max_param_diff(a, load_params(out / "member-1" / "model.ckpt-4.pt")) > 1e-3
    # statistics are the data's, the same in every member
    b = load_params(out / "member-1" / "model.ckpt-4.pt")
    for key in ("descriptor.davg", "descriptor.dstd", "out_bias"):
        assert torch.equal(a[key], b[key])
    for k in (0, 1):
        member = json.loads((out / f"member-{k}" / "out.json").read_text())
        assert member["model"]["descriptor"]["seed"] == 1 + k
        assert member["training"]["ensemble"] == 1
        state = torch.load(out / f"member-{k}" / "model.ckpt.pt", weights_only=True)
        assert state["committee"] == {"size": 2, "member": k, "sampling": "shared"}
    assert json.loads((out / "out.json").read_text())["training"]["ensemble"] == 2
    assert (out / "finished").exists()


def test_init_model_members_sample_with_training_seed_plus_k(tmp_path):
    inp = make_project(tmp_path, numb_steps=2, save_freq=2)
    assert train(inp, tmp_path / "base") == 0
    start = str(tmp_path / "base" / "model.ckpt-2.pt")
    committee = with_changes(inp, "committee.json", numb_steps=3, save_freq=3, ensemble=2)
    assert train(committee, tmp_path / "committee", "--init-model", start) == 0
    out = tmp_path / "committee"
    for k in (0, 1):
        single = with_changes(inp, f"single_{k}.json", training_seed=k, numb_steps=3, save_freq=3)
        assert train(single, tmp_path / f"single_{k}", "--init-model", start) == 0
        assert_same_run(out / f"member-{k}", tmp_path / f"single_{k}", 3)
        member = json.loads((out / f"member-{k}" / "out.json").read_text())
        assert member["training"]["seed"] == 7 + k
    a = load_params(out / "member-0" / "model.ckpt-3.pt")
    assert max_param_diff(a, load_params(out / "member-1" / "model.ckpt-3.pt")) > 1e-8


def test_finetune_members_sample_with_training_seed_plus_k(tmp_path):
    """--finetune with --ensemble: the pretrained weights and refitted bias in every member,
    member k the single fine-tuning run with the training seed + k."""
    inp = make_project(tmp_path, numb_steps=1, save_freq=1)
    assert train(inp, tmp_path / "base") == 0
    start = str(tmp_path / "base" / "model.ckpt-1.pt")
    steps = {"numb_steps": 2, "save_freq": 2}
    committee = with_changes(inp, "committee.json", **steps)
    assert train(committee, tmp_path / "committee", "--finetune", start, "--ensemble", "2") == 0
    single = with_changes(inp, "single_1.json", training_seed=1, **steps)
    assert train(single, tmp_path / "single_1", "--finetune", start) == 0
    assert_same_run(tmp_path / "committee" / "member-1", tmp_path / "single_1", 2)


def test_restart_auto_resumes_every_member_exactly(tmp_path):
    inp = make_project(tmp_path, numb_steps=4, save_freq=2, ensemble=2)
    assert train(inp, tmp_path / "full") == 0
    assert train(inp, tmp_path / "part") == 0
    part = tmp_path / "part"
    # killed while saving step 4: member 0 wrote it, member 1 did not
    os.remove(part / "member-1" / "model.ckpt-4.pt")
    os.remove(part / "finished")
    assert train(inp, part, "--restart", "auto") == 0
    for k in (0, 1):  # both from step 2: member 0's lone step-4 checkpoint is not used
        assert_same_run(part / f"member-{k}", tmp_path / "full" / f"member-{k}", 4)
        rows = lcurve_rows(part / f"member-{k}" / "lcurve.out")
        assert rows[:, 0].tolist() == [1, 2, 4]


def test_restart_from_a_member_checkpoint(tmp_path):
    inp = make_project(tmp_path, numb_steps=4, save_freq=2)
    assert train(inp, tmp_path / "full", "--ensemble", "2") == 0
    assert train(inp, tmp_path / "part", "--ensemble", "2") == 0
    part = tmp_path / "part"
    resume = part / "member-1" / "model.ckpt-2.pt"
    assert train(inp, part, "--ensemble", "2", "--restart", str(resume)) == 0
    for k in (0, 1):
        assert_same_run(part / f"member-{k}", tmp_path / "full" / f"member-{k}", 4)


def test_null_seeds_draw_one_base_seed(tmp_path):
    inp = make_project(tmp_path, numb_steps=1, save_freq=1)
    config = json.loads(inp.read_text())
    for section in ("descriptor", "fitting_net"):
        config["model"][section]["seed"] = None
    inp.write_text(json.dumps(config))
    assert train(inp, tmp_path / "out", "--ensemble", "3") == 0
    out = tmp_path / "out"
    base = json.loads((out / "out.json").read_text())["model"]["descriptor"]["seed"]
    assert isinstance(base, int)
    for k in range(3):
        member = json.loads((out / f"member-{k}" / "out.json").read_text())["model"]
        assert member["descriptor"]["seed"] == member["fitting_net"]["seed"] == base + k


def test_freeze_and_test_take_a_member(tmp_path):
    inp = make_project(tmp_path, numb_steps=2, save_freq=2)
    assert train(inp, tmp_path / "out", "--ensemble", "2") == 0
    member = tmp_path / "out" / "member-1"
    frozen = tmp_path / "member-1.pth"
    assert main(["freeze", str(member / "model.ckpt.pt"), "-o", str(frozen)]) == 0
    report = tmp_path / "test.json"
    valid = str(tmp_path / "data" / "valid")
    assert main(["test", "-m", str(frozen), "-s", valid, "--json", str(report)]) == 0
    from_ckpt = tmp_path / "ckpt.json"
    ckpt = str(member / "model.ckpt.pt")
    assert main(["test", "-m", ckpt, "-s", valid, "--json", str(from_ckpt)]) == 0
    a, b = json.loads(report.read_text())["total"], json.loads(from_ckpt.read_text())["total"]
    for key in ("energy_rmse", "force_rmse", "virial_rmse"):
        assert a[key] == pytest.approx(b[key], rel=1e-10)
    # member 1's own numbers, not member 0's
    other = tmp_path / "member-0.json"
    ckpt0 = str(tmp_path / "out" / "member-0" / "model.ckpt.pt")
    assert main(["test", "-m", ckpt0, "-s", valid, "--json", str(other)]) == 0
    assert json.loads(other.read_text())["total"]["force_rmse"] != b["force_rmse"]


@pytest.mark.parametrize("value", ["0", "-2"])
def test_bad_ensemble_is_one_line(tmp_path, capsys, value):
    inp = make_project(tmp_path, numb_steps=1)
    assert train(inp, tmp_path / "out", "--ensemble", value) == 1
    err = capsys.readouterr().err
    assert "ensemble" in err and len(err.strip().splitlines()) == 1


def test_a_member_checkpoint_continues_as_a_single_run(tmp_path):
    """A member's checkpoint holds what a single run's does: continued alone it gives the
    member's next steps."""
    inp = make_project(tmp_path, numb_steps=4, save_freq=2)
    assert train(inp, tmp_path / "committee", "--ensemble", "2") == 0
    member = tmp_path / "committee" / "member-1"
    alone = tmp_path / "alone"
    assert train(inp, alone, "--restart", str(member / "model.ckpt-2.pt")) == 0
    a, b = load_params(alone / "model.ckpt-4.pt"), load_params(member / "model.ckpt-4.pt")
    assert max_param_diff(a, b) < TOL


def test_out_of_memory_splits_the_shared_batch_without_changing_the_members(tmp_path, monkeypatch):
    """The batch controller splits a committee's shared batch into micro-batches (train_b's
    2 frames x 24 atoms do not fit, train_a's 2 x 18 do) and every member's result stays
    the unsplit committee's; every member's checkpoint records the split."""
    inp = make_project(tmp_path, numb_steps=4, save_freq=4, ensemble=2)
    assert train(inp, tmp_path / "plain") == 0
    monkeypatch.setenv(memory.SIMULATE_ATOMS_ENV, "40")
    monkeypatch.delenv(memory.SIMULATE_RANKS_ENV, raising=False)
    assert train(inp, tmp_path / "split") == 0
    for k in (0, 1):
        assert_same_run(tmp_path / "split" / f"member-{k}", tmp_path / "plain" / f"member-{k}", 4)
        state = torch.load(
            tmp_path / "split" / f"member-{k}" / "model.ckpt-4.pt", weights_only=True
        )
        assert [(e["size"], e["nsplit"]) for e in state["controller_state"]["sizes"]] == [(48, 2)]


def test_committee_training_on_another_device_equals_the_cpu(tmp_path, monkeypatch):
    """The committee's step, validation and checkpoints with the models on another device
    (``OtherDevice``, as tests/train/test_placement.py does for one model): every tensor
    where it belongs, and the same members as on the CPU."""
    monkeypatch.setenv("MDTRAIN_BACKEND", "fused")
    inp = make_project(tmp_path, numb_steps=2, save_freq=2, disp_freq=1, ensemble=2)
    assert train(inp, tmp_path / "cpu") == 0
    with monkeypatch.context() as patch, OtherDevice():
        patch.setattr(runtime_module, "select_device", lambda env, use_cuda=None: OTHER)
        assert train(inp, tmp_path / "other") == 0
    for k in (0, 1):
        a, b = (tmp_path / d / f"member-{k}" for d in ("cpu", "other"))
        assert (
            max_param_diff(load_params(a / "model.ckpt-2.pt"), load_params(b / "model.ckpt-2.pt"))
            < 1e-12
        )
        np.testing.assert_allclose(
            lcurve_rows(b / "lcurve.out"), lcurve_rows(a / "lcurve.out"), rtol=1e-9
        )
