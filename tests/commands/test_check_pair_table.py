"""`mdtrain check` and the input loader with a pair table (`use_srtab`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mdtrain.check import check_config
from mdtrain.config import load_config
from tests.helpers.pair_tables import write_table, zbl_table
from tests.helpers.training import make_project

SWITCH = {"smin_alpha": 0.1, "sw_rmin": 0.8, "sw_rmax": 1.0}


def project(tmp_path: Path, **model) -> Path:
    path = make_project(tmp_path)
    config = json.loads(path.read_text())
    config["model"].update(model)
    path.write_text(json.dumps(config))
    return path


def problems(path: Path) -> list[str]:
    return check_config(json.loads(path.read_text()), str(path)).problems


def test_a_good_table_passes_and_its_path_is_taken_from_the_input_folder(tmp_path):
    write_table(tmp_path / "zbl.txt", zbl_table(["O", "H"], 0.1, 4.0, 0.05))
    path = project(tmp_path, use_srtab="zbl.txt", **SWITCH)
    assert problems(path) == []
    assert load_config(path)["model"]["use_srtab"] == str(tmp_path / "zbl.txt")


@pytest.mark.parametrize(
    "rows, expected",
    [
        (None, "no such file"),
        (zbl_table(["O", "H", "C"], 0.1, 4.0, 0.05), "a table for 3 types, but type_map"),
    ],
)
def test_a_bad_table_is_one_problem_naming_it(tmp_path, rows, expected):
    if rows is not None:
        write_table(tmp_path / "zbl.txt", rows)
    path = project(tmp_path, use_srtab="zbl.txt", **SWITCH)
    found = problems(path)
    assert len(found) == 1 and "model.use_srtab" in found[0] and expected in found[0], found
    assert str(tmp_path / "zbl.txt") in found[0]


@pytest.mark.parametrize(
    "switch, expected",
    [
        ({"sw_rmin": 0.8}, "model.sw_rmax: required with model.use_srtab"),
        (
            {"sw_rmin": 1.0, "sw_rmax": 0.8},
            "model.sw_rmax: 0.8 must be greater than model.sw_rmin 1.0",
        ),
    ],
)
def test_switch_window_is_checked(tmp_path, switch, expected):
    write_table(tmp_path / "zbl.txt", zbl_table(["O", "H"], 0.1, 4.0, 0.05))
    path = project(tmp_path, use_srtab="zbl.txt", **switch)
    found = problems(path)
    assert any(expected in p for p in found), found
