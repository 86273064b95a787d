"""Restarts never start over on top of existing work (issue 26): ``--restart auto`` on a
committee with a member missing, damaged without an earlier step every member has, or of
another size, stops with one line naming the member and what to do, and every file on disk
is unchanged (sha256 before and after); a damaged newest step with an earlier intact one
resumes from that; a single run is not pointed at a committee's folder. ``--ensemble N``
that cannot fit is refused before anything is created, and a failed run leaves no empty
folders. All in-process, float64, tiny models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mdtrain.cli import main
from mdtrain.train import ensemble_budget
from tests.helpers.training import lcurve_rows, make_project, snapshot


def train(input_path, out, *extra: str) -> int:
    return main(["train", str(input_path), "-o", str(out), *extra])


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.err + captured.out).splitlines() if ln.startswith("ERROR")]
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.fixture(scope="module")
def finished_committee(tmp_path_factory) -> Path:
    """A committee of 2 trained for 4 steps, checkpoints at steps 2 and 4 (made once)."""
    root = tmp_path_factory.mktemp("committee")
    inp = make_project(root, numb_steps=4, save_freq=2, disp_freq=1)
    assert train(inp, root / "out", "--ensemble", "2") == 0
    return root


@pytest.fixture
def committee(finished_committee, tmp_path) -> Path:
    """A private copy of ``finished_committee``; returns its root (input.json, out/)."""
    root = tmp_path / "c"
    shutil.copytree(finished_committee, root, symlinks=True)
    return root


def refused(root: Path, capsys, *extra: str) -> str:
    """``train --restart auto`` with ``extra`` fails with one line and changes no file."""
    before = snapshot(root)
    assert train(root / "input.json", root / "out", "--restart", "auto", *extra) == 1
    line = error_line(capsys)
    assert snapshot(root) == before
    return line


def test_a_missing_member_is_named_not_overwritten(committee, capsys):
    shutil.rmtree(committee / "out" / "member-1")
    line = refused(committee, capsys, "--ensemble", "2")
    assert "member 1" in line and "is missing" in line and "another -o" in line


def test_a_damaged_member_without_an_earlier_step_is_named(committee, capsys):
    member = committee / "out" / "member-1"
    (member / "model.ckpt-2.pt").unlink()  # no earlier step every member has
    newest = member / "model.ckpt-4.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # torn
    line = refused(committee, capsys, "--ensemble", "2")
    assert "member 1 is damaged" in line and "model.ckpt-4.pt" in line


def test_a_committee_of_another_size_is_refused(committee, capsys):
    line = refused(committee, capsys, "--ensemble", "3")
    assert "holds a committee of 2" in line and "--ensemble 2" in line
    assert not (committee / "out" / "member-2").exists()


def test_a_single_run_is_not_pointed_at_a_committee(committee, capsys):
    line = refused(committee, capsys)
    assert "holds a committee (member-0 ... member-1)" in line and "--ensemble 2" in line


def test_a_damaged_newest_step_resumes_from_the_earlier_one(committee, capsys):
    member = committee / "out" / "member-1"
    newest = member / "model.ckpt-4.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    earlier = (committee / "out" / "member-0" / "model.ckpt-2.pt").read_bytes()
    assert train(committee / "input.json", committee / "out", "--restart", "auto",
                 "--ensemble", "2") == 0  # fmt: skip
    log = capsys.readouterr().err
    assert "continuing the committee from" in log and "at step 2" in log
    for k in (0, 1):  # steps 3 and 4 trained again, once each
        rows = lcurve_rows(committee / "out" / f"member-{k}" / "lcurve.out")
        assert rows[:, 0].tolist() == [1, 2, 3, 4]
    assert (committee / "out" / "member-0" / "model.ckpt-2.pt").read_bytes() == earlier


def test_a_single_run_with_only_damaged_checkpoints_is_refused(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=2, save_freq=2)
    assert train(inp, tmp_path / "out") == 0
    ckpt = tmp_path / "out" / "model.ckpt-2.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    line = refused(tmp_path, capsys)
    assert "no checkpoint in" in line and "model.ckpt-2.pt" in line


def test_an_ensemble_that_cannot_fit_is_refused_before_anything_is_made(
    tmp_path, capsys, monkeypatch
):
    """The reported hang: --ensemble 1000 made 1000 folders and no step in two minutes."""
    inp = make_project(tmp_path, numb_steps=2)
    monkeypatch.setattr(ensemble_budget, "available_memory", lambda device: 64 << 20)
    before = snapshot(tmp_path)
    assert train(inp, tmp_path / "out", "--ensemble", "1000") == 1
    line = error_line(capsys)
    assert "--ensemble 1000:" in line and "MiB free on cpu" in line and "members fit" in line
    assert not (tmp_path / "out").exists() and snapshot(tmp_path) == before


def test_an_ensemble_beyond_the_open_file_limit_is_refused(tmp_path, capsys, monkeypatch):
    inp = make_project(tmp_path, numb_steps=2)
    monkeypatch.setattr(ensemble_budget, "open_file_limit", lambda: 1024)
    assert train(inp, tmp_path / "out", "--ensemble", "1000") == 1
    assert "the limit is 1024 (ulimit -n)" in error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_the_estimate_counts_the_parameters_a_member_has():
    from mdtrain.model.energy import EnergyModel
    from tests.helpers.training import tiny_config

    config = tiny_config()["model"]
    config["descriptor"]["sel"] = [16, 28]
    cost = ensemble_budget.member_cost(config, batch_atoms=48)
    assert cost.exact
    assert cost.nparams == sum(p.numel() for p in EnergyModel(config).parameters())


def test_a_failed_run_leaves_no_empty_folders(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=2)
    (tmp_path / "data" / "train_b" / "set.000" / "coord.npy").write_bytes(b"not an array")
    assert train(inp, tmp_path / "runs" / "out", "--ensemble", "2") == 1
    assert "train_b" in error_line(capsys)
    assert not (tmp_path / "runs").exists()


def test_a_start_model_among_the_checkpoints_the_run_writes_is_refused(committee, capsys):
    start = str(committee / "out" / "member-0" / "model.ckpt-2.pt")
    before = snapshot(committee)
    argv = ["--ensemble", "2", "--init-model", start]
    assert train(committee / "input.json", committee / "out", *argv) == 1
    assert f"--init-model {start}: a checkpoint of the output directory" in error_line(capsys)
    assert snapshot(committee) == before
