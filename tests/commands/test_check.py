"""`mdtrain check`: exit status and the problems it lists, on tiny generated systems."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mdtrain.check import check_systems
from mdtrain.cli import main


def make_system(
    path: Path,
    types=(0, 1, 1),
    names=("O", "H"),
    nframes=4,
    sets=1,
    labels=("energy", "force"),
    seed=0,
) -> Path:
    """A deepmd/npy system of random atoms in a 5 Å cubic box."""
    rng = np.random.default_rng(seed)
    natoms = len(types)
    path.mkdir(parents=True)
    (path / "type.raw").write_text("\n".join(str(t) for t in types) + "\n")
    if names is not None:
        (path / "type_map.raw").write_text("\n".join(names) + "\n")
    for s in range(sets):
        d = path / f"set.{s:03d}"
        d.mkdir()
        np.save(d / "coord.npy", rng.uniform(0, 5, (nframes, natoms * 3)))
        np.save(d / "box.npy", np.tile(np.eye(3).ravel() * 5.0, (nframes, 1)))
        if "energy" in labels:
            np.save(d / "energy.npy", rng.normal(size=nframes))
        if "force" in labels:
            np.save(d / "force.npy", rng.normal(size=(nframes, natoms * 3)))
    return path


def write_input(tmp_path: Path, training, validation=None, **training_extra) -> Path:
    data = {
        "_comment": "tiny",
        "model": {
            "type_map": ["O", "H"],
            "descriptor": {"type": "se_a", "sel": [4, 8], "rcut": 3.0, "rcut_smth": 0.5},
        },
        "training": {
            "training_data": {"systems": training, "batch_size": 1},
            "numb_steps": 10,
            **training_extra,
        },
    }
    if validation is not None:
        data["training"]["validation_data"] = {"systems": validation}
    path = tmp_path / "input.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def run(path: Path, capsys) -> tuple[int, list[str]]:
    code = main(["check", str(path)])
    return code, capsys.readouterr().out.strip().splitlines()


def test_good_input_and_data(tmp_path, capsys):
    make_system(tmp_path / "data" / "a", nframes=4)
    make_system(tmp_path / "data" / "b", nframes=3, sets=2, types=(1, 0, 0, 1), names=("H", "O"))
    make_system(tmp_path / "valid", nframes=5)
    path = write_input(tmp_path, "data", validation=["valid"])
    code, lines = run(path, capsys)
    assert code == 0, lines
    assert lines == [
        "OK: 3 systems, 15 frames (training: 2 systems, 10 frames; validation: 1 system, 5 frames)"
    ]


def test_bad_data_lists_every_problem(tmp_path, capsys):
    make_system(tmp_path / "good", nframes=3)
    nan = make_system(tmp_path / "nan", nframes=6)
    force = np.load(nan / "set.000" / "force.npy")
    force[2, 4] = np.nan
    force[5, 0] = np.inf
    np.save(nan / "set.000" / "force.npy", force)
    make_system(tmp_path / "carbon", names=("C", "H"))
    shape = make_system(tmp_path / "shape")
    (shape / "type.raw").write_text("0\n1\n")  # 2 atoms, but coord.npy has 3
    path = write_input(tmp_path, ["good", "nan", "carbon", "shape", "missing"], validation="good")
    code, lines = run(path, capsys)
    assert code == 1
    assert lines[-1] == "FAILED: 4 problems"
    text = "\n".join(lines)
    assert "missing" in text and "does not exist" in text
    nan_line = next(line for line in lines if "nan" in line and "frame" in line)
    assert "force" in nan_line and "frame 2, 5" in nan_line
    assert any("carbon" in line and "C" in line and "type_map" in line for line in lines)
    assert any("shape" in line and "coord.npy" in line for line in lines)
    assert not any(line.startswith("OK") for line in lines)


def test_config_and_data_problems_together(tmp_path, capsys):
    make_system(tmp_path / "a")
    make_system(tmp_path / "b")
    path = write_input(tmp_path, ["a", "b"], disp_frq=10, neighbor_stat_file="nope.json")
    config = json.loads(path.read_text())
    config["training"]["training_data"]["batch_size"] = [1, 2, 3]
    path.write_text(json.dumps(config))
    code, lines = run(path, capsys)
    assert code == 1
    assert f"{path}: training.disp_frq: unknown key; did you mean 'disp_freq'?" in lines
    assert any(
        "neighbor_stat_file" in line and "nope.json does not exist" in line for line in lines
    )
    assert any(
        "training.training_data.batch_size: needs one entry per system (2" in line for line in lines
    )
    assert lines[-1] == "FAILED: 3 problems"


def test_malformed_json(tmp_path, capsys):
    path = tmp_path / "input.json"
    path.write_text('{"model": {"type_map": ["O" "H"]}}')
    code, lines = run(path, capsys)
    assert code == 1
    assert lines[0].startswith(f"{path}: invalid JSON at line 1 column 29:")


def test_missing_input_file(tmp_path, capsys):
    code, lines = run(tmp_path / "none.json", capsys)
    assert code == 1
    assert lines == [f"{tmp_path / 'none.json'}: no such file"]


@pytest.mark.parametrize("label", ["coord", "energy"])
def test_check_systems_names_system_and_frame(tmp_path, label):
    system = make_system(tmp_path / "s", nframes=3)
    name = "coord.npy" if label == "coord" else "energy.npy"
    values = np.load(system / "set.000" / name)
    values[1] = np.nan
    np.save(system / "set.000" / name, values)
    problems = check_systems([str(system)], ["O", "H"])
    assert len(problems) == 1
    assert str(system) in problems[0] and label in problems[0] and "frame 1" in problems[0]
    assert check_systems([str(make_system(tmp_path / "t"))], ["O", "H"]) == []


def test_check_and_neighbor_stat_do_not_import_torch():
    """Both run before a long job is queued, often on a login node: importing torch costs
    seconds (ten times that on a loaded machine)."""
    code = (
        "import sys, mdtrain.commands.check, mdtrain.commands.neighbor_stat\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
