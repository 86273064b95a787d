"""Nothing a user owns is lost (issue 26), command by command: an output that resolves to
one of the command's inputs, or lands on a file of another kind, is refused before any work
with one line naming both, and every file is unchanged (sha256 before and after); results
that cannot be right (NaN weights, non-finite predictions, two copies of one model, a
neighbour-stat file that was edited) are said, not printed as numbers; and the four unclear
messages name what is wrong. The committee restarts are in tests/train/test_committee_restart.py."""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mdtrain.cli import _HANDLERS, main
from mdtrain.errors import MDTrainError
from mdtrain.infer.calculator import MDTrainCalculator
from mdtrain.infer.model_devi import trust_counts
from mdtrain.outputs import (
    KIND_CHECKPOINT,
    KIND_DATA,
    KIND_DP,
    KIND_FROZEN,
    KIND_MODEL_DEVI,
    KIND_NEIGHBOR_STAT,
    KIND_STAT,
    KIND_TRAJECTORY,
    file_kind,
)
from tests.helpers.committee import committee_folder, member_model, write_model
from tests.helpers.models import water_like
from tests.helpers.training import make_project, snapshot
from tests.helpers.trajectories import write_extxyz, write_lammps_dump

BOX = np.diag([6.0, 6.0, 6.0])


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.err + captured.out).splitlines() if ln.startswith("ERROR")]
    assert "Traceback" not in captured.err
    assert len(lines) == 1, captured.err
    return lines[0]


def trajectory(path: Path, types_last: int | None = None) -> str:
    """Two frames of 3 water-like molecules as extended XYZ (or, with ``types_last``, a
    LAMMPS dump whose last atom has that type index)."""
    coord, atype = water_like(3, BOX, seed=1)
    if types_last is not None:
        atype = atype.copy()
        atype[-1] = types_last
        return write_lammps_dump(
            path, np.stack([coord, coord]), atype, np.stack([BOX, BOX]), [0, 10]
        )
    symbols = [["O" if t == 0 else "H" for t in atype]] * 2
    return write_extxyz(path, np.stack([coord, coord + 0.01]), symbols, [BOX, BOX])


@pytest.fixture
def committee(tmp_path) -> Path:
    """A committee folder of two tiny members (member-k/model.ckpt.pt) and a trajectory."""
    committee_folder(tmp_path / "comm", [member_model(0), member_model(1)])
    trajectory(tmp_path / "traj.extxyz")
    return tmp_path


def refused(root: Path, capsys, argv: list[str]) -> str:
    """``argv`` fails with one line and no file below ``root`` changes."""
    before = snapshot(root)
    assert main(argv) == 1
    line = error_line(capsys)
    assert snapshot(root) == before
    return line


# ------------------------------------------------------------------- outputs over inputs


def test_model_devi_output_naming_its_trajectory(committee, capsys, monkeypatch):
    monkeypatch.chdir(committee)
    os.symlink("traj.extxyz", committee / "alias.extxyz")
    for target in ("traj.extxyz", "./comm/../traj.extxyz", "alias.extxyz"):
        argv = ["model-devi", "-m", "comm", "-s", "traj.extxyz", "-o", target]
        line = refused(committee, capsys, argv)
        assert f"-o {target}: is the input -s traj.extxyz" in line


def test_model_devi_output_naming_a_checkpoint(committee, capsys, monkeypatch):
    monkeypatch.chdir(committee)
    member = os.path.join("comm", "member-1", "model.ckpt.pt")
    line = refused(
        committee, capsys, ["model-devi", "-m", "comm", "-s", "traj.extxyz", "-o", member]
    )
    assert f"is the input -m {member}" in line
    other = write_model(member_model(2), committee / "other" / "model.ckpt-3.pt")
    line = refused(
        committee, capsys, ["model-devi", "-m", "comm", "-s", "traj.extxyz", "-o", other]
    )
    assert f"the file is {KIND_CHECKPOINT}, not {KIND_MODEL_DEVI}" in line


def test_freeze_output_naming_its_checkpoint(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=2, save_freq=2)
    assert main(["train", str(inp), "-o", str(tmp_path / "fz")]) == 0
    ckpt = str(tmp_path / "fz" / "model.ckpt-2.pt")
    line = refused(tmp_path, capsys, ["freeze", ckpt, "-o", ckpt])
    assert f"-o {ckpt}: is the input checkpoint {ckpt}" in line
    # the folder's model.ckpt.pt is a link to model.ckpt-2.pt: the same file
    line = refused(tmp_path, capsys, ["freeze", str(tmp_path / "fz"), "-o", ckpt])
    assert f"both resolve to {os.path.realpath(ckpt)}" in line
    assert main(["train", str(inp), "-o", str(tmp_path / "fz"), "--restart", "auto"]) == 0


def test_an_output_over_the_hdf5_file_of_a_system(tmp_path, capsys, water_h5):
    """``-s water.h5#/water`` reads water.h5: ``-o water.h5`` is that input."""
    h5 = water_h5.partition("#")[0]
    argv = ["neighbor-stat", "-s", water_h5, "-r", "4", "-t", "O", "H", "-o", h5]
    assert f"-o {h5}: is the input -s {water_h5}" in refused(tmp_path, capsys, argv)


@pytest.mark.parametrize("kind", ["packed data", "dp model", "training data itself"])
def test_stat_file_never_writes_into_another_kind(tmp_path, capsys, kind):
    inp = make_project(tmp_path, numb_steps=1)
    packed = str(tmp_path / "packed.h5")
    assert main(["convert", "--pack", str(tmp_path / "data" / "valid"), "-o", packed]) == 0
    config = json.loads(inp.read_text())
    if kind == "dp model":
        config["training"]["stat_file"] = write_model(member_model(0), tmp_path / "m.dp")
    else:
        config["training"]["stat_file"] = packed
    if kind == "training data itself":
        config["training"]["validation_data"]["systems"] = [packed]
    inp.write_text(json.dumps(config))
    line = refused(tmp_path, capsys, ["train", str(inp), "-o", str(tmp_path / "out")])
    assert line.startswith("ERROR training.stat_file")
    if kind == "training data itself":
        assert "is the input training.validation_data.systems" in line
    else:
        wanted = KIND_DP if kind == "dp model" else KIND_DATA
        assert f"the file is {wanted}, not {KIND_STAT}" in line
    assert not (tmp_path / "out").exists()


def test_file_kinds_are_told_by_content(tmp_path, committee):
    frozen = write_model(member_model(0), tmp_path / "model.ckpt")  # a checkpoint's name...
    os.replace(write_model(member_model(0), tmp_path / "x.pth"), frozen)  # ...frozen content
    assert file_kind(frozen) == KIND_FROZEN
    assert file_kind(committee / "comm" / "member-0" / "model.ckpt.pt") == KIND_CHECKPOINT
    assert file_kind(write_model(member_model(0), tmp_path / "m.dp")) == KIND_DP
    assert file_kind(committee / "traj.extxyz") == KIND_TRAJECTORY
    assert file_kind(trajectory(tmp_path / "t.dump", types_last=1)) == KIND_TRAJECTORY
    with h5py.File(tmp_path / "stat.h5", "w") as f:
        f["O H/abc/r_0"] = np.zeros(3)
    assert file_kind(tmp_path / "stat.h5") == KIND_STAT
    (tmp_path / "ns.json").write_text(json.dumps({"max_nbor_size": [1]}))
    assert file_kind(tmp_path / "ns.json") == KIND_NEIGHBOR_STAT
    (tmp_path / "empty").write_text("")
    assert file_kind(tmp_path / "empty") is None and file_kind(tmp_path / "nothing") is None


def test_every_command_that_writes_checks_its_outputs():
    """The one rule lives in one helper, so a new command cannot forget it: every command
    module but ``check`` and ``show`` (which write nothing) calls ``check_outputs``;
    ``train``'s is called by ``mdtrain.train.workdir``."""
    root = Path(__file__).resolve().parents[2] / "mdtrain"
    delegated = {"train": root / "train" / "workdir.py"}
    for command, target in _HANDLERS.items():
        if command in ("check", "show"):
            continue
        module = target.split(":")[0].replace(".", "/") + ".py"
        path = delegated.get(command, root.parent / module)
        calls = {
            node.func.id
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        assert "check_outputs" in calls, f"{command} ({path}) does not call check_outputs"


# ------------------------------------------------------------------- results that cannot be right


def test_two_copies_of_one_model_are_warned(committee, capsys):
    copy = committee / "copy" / "model.ckpt.pt"
    copy.parent.mkdir()
    shutil.copy(committee / "comm" / "member-0" / "model.ckpt.pt", copy)
    first = str(committee / "comm" / "member-0" / "model.ckpt.pt")
    out = str(committee / "md.out")
    argv = ["model-devi", "-m", first, str(copy), "-s", str(committee / "traj.extxyz"), "-o", out]
    assert main(argv) == 0
    warned = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("WARNING")]
    assert any(first in ln and str(copy) in ln and "same model" in ln for ln in warned)


def nan_member(path: Path) -> str:
    model = member_model(1)
    with torch.no_grad():
        next(iter(model.fitting.parameters()))[0].fill_(float("nan"))
    return write_model(model, path)


def test_a_nan_member_is_an_error_naming_it(committee, capsys, monkeypatch, water_system):
    """It gave rows of nan and dropped every frame from the trust counts."""
    bad = nan_member(committee / "comm" / "member-1" / "model.ckpt.pt")
    monkeypatch.chdir(committee)
    argv = ["model-devi", "-m", "comm", "-s", "traj.extxyz", "-o", "md.out", "--trust-lo", "0.1",
            "--trust-hi", "0.3"]  # fmt: skip
    line = refused(committee, capsys, argv)
    assert os.path.join("comm", "member-1", "model.ckpt.pt") in line and "NaN" in line
    assert not (committee / "md.out").exists()
    assert "NaN" in refused(committee, capsys, ["test", "-m", bad, "-s", water_system])
    with pytest.raises(MDTrainError, match="NaN"):
        MDTrainCalculator(bad)


def test_non_finite_predictions_are_an_error_naming_model_and_frame(committee, water_system):
    model = member_model(0)
    model.set_out_bias(np.array([1e308, 1e308]))  # finite weights, an energy that overflows
    path = write_model(model, committee / "huge.pt")
    with pytest.raises(MDTrainError, match=r"huge\.pt: non-finite energy on frame 0 of"):
        main(["--debug", "test", "-m", path, "-s", water_system])
    calc = MDTrainCalculator(model)
    import ase

    coord, atype = water_like(3, BOX, seed=1)
    atoms = ase.Atoms(["O" if t == 0 else "H" for t in atype], coord, cell=BOX, pbc=True)
    atoms.calc = calc
    with pytest.raises(MDTrainError, match="non-finite energy"):
        atoms.get_potential_energy()


def test_no_frame_drops_out_of_the_trust_counts():
    values = np.array([0.05, 0.2, 0.5])
    assert sum(trust_counts(values, 0.1, 0.3).values()) == 3
    with pytest.raises(MDTrainError, match="not finite on 1 frame"):
        trust_counts(np.array([0.05, np.nan, 0.5]), 0.1, 0.3)


def edited_stat(tmp_path: Path, inp: Path, everywhere: bool) -> str:
    """A neighbour-stat file of the project whose counts were edited below the data's
    (only the totals, or ``everywhere``: its systems' entries too)."""
    path = tmp_path / "ns.json"
    assert main(["neighbor-stat", str(inp), "-o", str(path)]) == 0
    content = json.loads(path.read_text())
    content["max_nbor_size"] = [5, 10]
    if everywhere:
        for entry in content["systems"]:
            entry["max_nbor_size"] = [min(n, c) for n, c in zip(entry["max_nbor_size"], [5, 10])]
    path.write_text(json.dumps(content))
    return str(path)


def test_an_edited_neighbour_stat_file_is_refused(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=1)
    stat = edited_stat(tmp_path, inp, everywhere=False)
    argv = ["train", str(inp), "-o", str(tmp_path / "out"), "--neighbor-stat-file", stat]
    line = refused(tmp_path, capsys, argv)
    assert "max_nbor_size [5, 10] disagrees with its systems' largest counts" in line


@pytest.mark.parametrize("strict", [False, True])
def test_training_never_meets_more_neighbours_than_the_file_or_a_strict_sel(
    tmp_path, capsys, strict
):
    inp = make_project(tmp_path, numb_steps=1)
    stat = edited_stat(tmp_path, inp, everywhere=True)
    config = json.loads(inp.read_text())
    if strict:
        config["model"]["descriptor"]["sel"] = [8, 16]
        config["training"]["strict_sel"] = True
    inp.write_text(json.dumps(config))
    argv = ["train", str(inp), "-o", str(tmp_path / "out"), "--neighbor-stat-file", stat]
    assert main(argv) == 1
    line = error_line(capsys)
    assert "neighbours of type O within rcut, more than 5" in line and stat in line
    assert ("training.strict_sel" in line) == strict
    assert not list((tmp_path / "out").glob("model.ckpt*"))  # no step was taken


# ------------------------------------------------------------------- unclear messages


def test_a_dp_array_of_the_wrong_shape_is_named_with_both_shapes(tmp_path, water_system, capsys):
    path = write_model(member_model(0), tmp_path / "m.dp")
    with h5py.File(path, "a") as f:
        name = next(n for n in sorted(f) if f[n].ndim == 2 and f[n].shape[0] > 1)
        shape = f[name].shape
        del f[name]
        f[name] = np.zeros((shape[0] + 1, shape[1]))
    line = refused(tmp_path, capsys, ["test", "-m", path, "-s", water_system])
    assert f"has shape ({shape[0] + 1}, {shape[1]}), the model of its config needs {shape}" in line


@pytest.mark.parametrize("option", ["--init-model", "--finetune", "--restart"])
def test_a_frozen_model_given_as_a_checkpoint(tmp_path, capsys, option):
    inp = make_project(tmp_path, numb_steps=1)
    frozen = write_model(member_model(0), tmp_path / "frozen.pth")
    line = refused(tmp_path, capsys, ["train", str(inp), "-o", str(tmp_path / "o"), option, frozen])
    assert "this is a frozen model" in line and "give the checkpoint" in line
    assert "weights_only" not in line


@pytest.mark.parametrize("given", [[], ["-t", "O", "H"]])
def test_a_lammps_type_without_an_element(committee, capsys, given):
    dump = trajectory(committee / "t.dump", types_last=2)
    argv = ["model-devi", "-m", str(committee / "comm"), "-s", dump, *given, "-o", "md.out"]
    line = refused(committee, capsys, argv)
    assert "LAMMPS type 3 has no element" in line and "-t O H <element of type 3>" in line


def test_test_takes_a_training_folder(tmp_path, water_system, capsys):
    write_model(member_model(0), tmp_path / "run" / "model.ckpt.pt")
    assert main(["test", "-m", str(tmp_path / "run"), "-s", water_system]) == 0
    assert "Total over 1 system(s)" in capsys.readouterr().out
    committee_folder(tmp_path / "comm", [member_model(0), member_model(1)])
    line = refused(tmp_path, capsys, ["test", "-m", str(tmp_path / "comm"), "-s", water_system])
    assert "a committee folder; give one member" in line


def test_the_statistics_file_attribute_matches_what_outputs_recognise():
    from mdtrain import outputs
    from mdtrain.model.stat_file import DATA_ATTR

    assert outputs.STAT_FILE_ATTR == DATA_ATTR
