"""`mdtrain check` and the input loader with ``model.type`` ``linear_ener`` and ``pairtab``
(DeePMD-kit 3.2's keys): good inputs pass with their table paths taken from the input's
folder; each bad one is one line naming the key (and the file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mdtrain.check import check_config
from mdtrain.config import load_config
from tests.helpers.pair_tables import write_table, zbl_table
from tests.helpers.training import make_project


def linear_project(tmp_path: Path, table_types=("O", "H"), **change) -> Path:
    """The tiny project with its model made a linear_ener of the network and a table."""
    path = make_project(tmp_path)
    config = json.loads(path.read_text())
    net = config["model"]
    type_map = net.pop("type_map")
    write_table(tmp_path / "d3.txt", zbl_table(list(table_types), 0.1, 4.0, 0.01, zero_from=3.5))
    pairtab = {"type": "pairtab", "tab_file": "d3.txt", "rcut": 4.0, "sel": "auto"}
    model = {"type": "linear_ener", "type_map": type_map, "models": [net, pairtab]}
    config["model"] = {**model, "weights": "sum", **change}
    path.write_text(json.dumps(config))
    return path


def edited(path: Path, change) -> Path:
    """The input at ``path`` with ``change(config)`` applied."""
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    return path


def problems(path: Path) -> list[str]:
    return check_config(json.loads(path.read_text()), str(path)).problems


def test_a_linear_model_passes_with_its_defaults_and_table_path(tmp_path):
    path = linear_project(tmp_path)
    assert problems(path) == []
    model = load_config(path)["model"]
    assert model["data_stat_nbatch"] == 10  # DeePMD-kit's default: the whole's counts
    net, table = model["models"]
    assert net["type"] == "standard" and net["data_stat_nbatch"] == 2  # as the part gives it
    assert net["fitting_net"]["type"] == "ener"
    assert table["tab_file"] == str(tmp_path / "d3.txt")  # from the input's folder


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"weights": [1.0, 2.0, 0.5]}, "model.weights: 3 weights for 2 models"),
        ({"weights": "median"}, "model.weights: "),
        ({"shared_dict": {"a": 1}}, "model.shared_dict: not supported by mdtrain"),
        ({"models": []}, "model.models: needs at least 1 entry"),
    ],
)
def test_bad_linear_settings_are_one_line_naming_the_key(tmp_path, change, expected):
    found = problems(linear_project(tmp_path, **change))
    assert len(found) == 1 and expected in found[0], found


def test_weights_are_required(tmp_path):
    path = edited(linear_project(tmp_path), lambda c: c["model"].pop("weights"))
    assert problems(path) == [f"{path}: model.weights: missing (required)"]


def test_a_table_for_other_types_names_the_part_and_the_file(tmp_path):
    found = problems(linear_project(tmp_path, table_types=("O", "H", "C")))
    table = tmp_path / "d3.txt"
    assert found == [
        f"{tmp_path / 'input.json'}: model.models[1].tab_file: {table}: has 6 energy "
        "columns, a table for 3 types, but type_map ['O', 'H'] has 2 types (3 columns)"
    ], found


def test_parts_are_checked_like_models_named_by_their_index(tmp_path):
    path = linear_project(tmp_path)
    config = json.loads(path.read_text())
    config["model"]["models"][0]["descriptor"]["rcut_smth"] = 5.0
    config["model"]["models"][0]["use_srtab"] = "d3.txt"
    config["model"]["models"][1]["type_map"] = ["H", "O"]
    path.write_text(json.dumps(config))
    found = problems(path)
    assert any(
        "model.models[0].descriptor.rcut_smth: must be smaller than rcut" in p for p in found
    )
    assert any("model.models[0].use_srtab: a DP+ZBL model cannot be a part" in p for p in found)
    assert any("model.models[1].type_map: must be model.type_map" in p for p in found)


def test_a_part_of_unknown_type_is_named(tmp_path):
    path = linear_project(tmp_path)
    config = json.loads(path.read_text())
    config["model"]["models"][1]["type"] = "linear_ener"  # no linear model inside a linear one
    path.write_text(json.dumps(config))
    found = problems(path)
    assert len(found) == 1 and "model.models[1].type" in found[0], found


def test_a_pairtab_model_alone_is_refused_for_training(tmp_path):
    path = make_project(tmp_path)
    config = json.loads(path.read_text())
    write_table(tmp_path / "t.txt", zbl_table(["O", "H"], 0.1, 4.0, 0.01, zero_from=3.5))
    config["model"] = {"type": "pairtab", "type_map": ["O", "H"], "tab_file": "t.txt",
                       "rcut": 4.0, "sel": 40}  # fmt: skip
    path.write_text(json.dumps(config))
    found = problems(path)
    assert len(found) == 1 and "a pairtab model alone has no weights to train" in found[0]


def test_a_linear_model_needs_a_type_map(tmp_path):
    path = edited(linear_project(tmp_path), lambda c: c["model"].pop("type_map"))
    assert problems(path) == [f"{path}: model.type_map: required with model.type 'linear_ener'"]


def test_network_parts_must_take_the_same_frame_parameters(tmp_path):
    path = linear_project(tmp_path)

    def two_nets(config, second):
        net = config["model"]["models"][0]
        config["model"]["models"] = [
            {**net, "fitting_net": {**net["fitting_net"], "numb_fparam": 2}},
            {**net, "fitting_net": {**net["fitting_net"], **second}},
        ]

    edited(path, lambda c: two_nets(c, {"numb_fparam": 2}))
    found = problems(path)  # the same: accepted, and the data must hold them
    assert not [p for p in found if "model.models" in p]
    assert any("fparam.npy is missing (the model has numb_fparam = 2)" in p for p in found)
    edited(path, lambda c: two_nets(c, {"numb_fparam": 3}))
    found = [p.split(": ", 1)[1] for p in problems(path) if "model.models" in p]
    assert found == [
        "model.models: numb_fparam differs between model.models[0] and model.models[1]; the "
        "parts are given the same frame/atomic parameters"
    ]
