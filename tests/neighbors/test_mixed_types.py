"""One ``sel`` for all types (the descriptors with one type-mixed neighbour list): the total
neighbour count of mixed-type data, ``sel: "auto"`` for such descriptors, and its reports."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.config import MIXED_TYPES_DESCRIPTORS, mixed_types
from mdtrain.data import open_systems
from mdtrain.errors import MDTrainError
from mdtrain.neighbors.sel import auto_sel, resolve_sel
from mdtrain.neighbors.stat import compute_neighbor_stat
from mdtrain.train.prepare import DataSets, resolve_sel_and_min_dist
from tests.helpers.datagen import mixed_labeled, write_npy_system
from tests.helpers.reference import brute_force_pairs

RCUT = 4.0
TYPE_MAP = ["O", "H", "X"]


@pytest.fixture
def mixed(tmp_path):
    data = mixed_labeled(nframes=6, virtual=True, rcut=RCUT)
    return write_npy_system(tmp_path / "mixed", set_size=4, **data), data


def _brute_force(data: dict) -> tuple[list[int], int]:
    """Per-type and total largest neighbour counts over the real atoms of every frame."""
    per_type, total = np.zeros(len(TYPE_MAP), dtype=int), 0
    for f, row in enumerate(data["real_types"]):
        real = np.flatnonzero(row >= 0)
        counts = np.zeros((len(real), len(TYPE_MAP)), dtype=int)
        for i, j, *_ in brute_force_pairs(data["coords"][f, real], data["boxes"][f], RCUT):
            counts[i, row[real[j]]] += 1
        per_type = np.maximum(per_type, counts.max(axis=0))
        total = max(total, int(counts.sum(axis=1).max()))
    return per_type.tolist(), total


def test_total_count_of_mixed_type_data_matches_brute_force(mixed):
    path, data = mixed
    stat = compute_neighbor_stat(open_systems(path, TYPE_MAP), RCUT, 3, progress=False)
    per_type, total = _brute_force(data)
    assert stat.max_nbor_size == per_type and stat.max_nbor_total == total
    assert total < sum(per_type)  # the total is not the sum of the per-type maxima


def test_predicate_names_the_type_mixed_descriptors():
    assert MIXED_TYPES_DESCRIPTORS == ("se_atten", "dpa1", "se_atten_v2", "se_e3_tebd")
    assert all(mixed_types({"type": name}) for name in MIXED_TYPES_DESCRIPTORS)
    assert not any(mixed_types(d) for d in ({"type": "se_e2_a"}, {"type": "hybrid"}, None))


def test_one_sel_for_all_types(caplog):
    assert resolve_sel("auto", [46], mixed=True) == auto_sel([46])[0] == 52
    assert resolve_sel("auto:1.5", [46], mixed=True) == 72
    with caplog.at_level(logging.WARNING, logger="mdtrain"):
        assert resolve_sel([20, 20], [46], mixed=True) == 40  # a list stands for its sum
    assert "sel = 40 is smaller than the largest neighbour count 46" in caplog.text
    assert resolve_sel(120, [46], mixed=True) == 120


def _config(sel, **training) -> dict:
    """A config as training holds it (the schema does not yet know se_atten: not loaded)."""
    return {
        "model": {
            "type_map": TYPE_MAP,
            "descriptor": {"type": "se_atten", "sel": sel, "rcut": RCUT, "rcut_smth": 0.5},
        },
        "training": {"training_data": {"systems": []}, **training},
    }


def test_training_resolves_one_sel_from_the_total(mixed, tmp_path):
    path, data = mixed
    datasets = DataSets(open_systems(path, TYPE_MAP), [])
    total = _brute_force(data)[1]
    config, min_dist = resolve_sel_and_min_dist(_config("auto"), "in.json", datasets, None, False)
    assert config["model"]["descriptor"]["sel"] == auto_sel([total])[0] and min_dist > 0.9
    # from a neighbour-stat file, which records the total
    stat_file = tmp_path / "stat.json"
    assert main(["neighbor-stat", "-s", path, "-r", str(RCUT), "-t", *TYPE_MAP,
                 "-o", str(stat_file)]) == 0  # fmt: skip
    content = json.loads(stat_file.read_text())
    assert content["max_nbor_total"] == total and content["sel_total"] == auto_sel([total])[0]
    again, _ = resolve_sel_and_min_dist(_config("auto"), "in.json", datasets, str(stat_file), False)
    assert again["model"]["descriptor"]["sel"] == config["model"]["descriptor"]["sel"]
    del content["max_nbor_total"]
    stat_file.write_text(json.dumps(content))
    with pytest.raises(MDTrainError, match="no max_nbor_total .* run mdtrain neighbor-stat"):
        resolve_sel_and_min_dist(_config("auto"), "in.json", datasets, str(stat_file), False)
    # strict_sel compares the total; --skip-neighbor-stat keeps a given sel
    small = _config(total - 1, strict_sel=True)
    with pytest.raises(MDTrainError, match=f"largest neighbour count {total} .*all types"):
        resolve_sel_and_min_dist(small, "in.json", datasets, None, False)
    kept, _ = resolve_sel_and_min_dist(_config([10, 20, 30]), "in.json", datasets, None, True)
    assert kept["model"]["descriptor"]["sel"] == 60


def test_neighbor_stat_prints_the_total(mixed, tmp_path, capsys):
    path, data = mixed
    per_type, total = _brute_force(data)
    assert main(["neighbor-stat", "-s", path, "-r", str(RCUT), "-t", *TYPE_MAP,
                 "-o", str(tmp_path / "n.json")]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["type", "max", "neighbours", "sel", "(auto:1.1)"]
    assert lines[6].split() == ["all", "types", str(total), str(auto_sel([total])[0])]
    assert f"max_nbor_total: {total} (all types together)" in lines


def test_table_for_an_input_with_one_sel(mixed, tmp_path):
    """The summary of ``mdtrain neighbor-stat input.json`` when the input's descriptor takes
    one sel: the input's sel beside the total, and what "auto" would pick."""
    from mdtrain.commands.neighbor_stat import format_table
    from mdtrain.neighbors.stat_file import neighbor_stat_to_dict

    path, data = mixed
    stat = compute_neighbor_stat(open_systems(path, TYPE_MAP), RCUT, 3, progress=False)
    content = neighbor_stat_to_dict(stat, TYPE_MAP)
    total = _brute_force(data)[1]
    lines = format_table(stat, TYPE_MAP, content, "n.json", [40, 40, 40], mixed=True).splitlines()
    assert lines[2].split()[-3:] == ["sel", "in", "input"]
    assert lines[3].split()[-1] == "-" and lines[6].split()[-1] == "120"
    assert f'takes one sel for all types: "auto" gives {auto_sel([total])[0]}' in lines[-2]
    per_type = format_table(stat, TYPE_MAP, content, "n.json", [7, 8, 9]).splitlines()
    assert [row.split()[-1] for row in per_type[3:7]] == ["7", "8", "9", "-"]
