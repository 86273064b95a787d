"""benchmarks/first_epoch.py (the inputs of its runs, its in-process pairing) and
benchmarks/step_floor.py (operation counts, the table) on generated data: shapes and
counts only, never speed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.benchmarks import benchmark_module
from tests.helpers.training import make_project, tiny_config

first_epoch = benchmark_module("first_epoch")
step_floor = benchmark_module("step_floor")


def test_run_inputs_of_mdtrain_a_baseline_and_deepmd(tmp_path):
    config = tiny_config(stat_file="stat.h5", strict_sel=True)
    mine = first_epoch.run_input(config, str(tmp_path), 30, "float64", 2)["training"]
    assert mine["numb_steps"] == 30 and mine["nlist_prefetch"] == 2 and "stat_file" not in mine
    assert mine["validation_data"]["systems"] == [str(tmp_path / "data/valid")]
    assert "nlist_prefetch" not in first_epoch.run_input(config, ".", 3, "float64", -1)["training"]
    theirs = first_epoch.run_input(config, ".", 3, "float32", None)
    assert "nlist_prefetch" not in theirs["training"] and "strict_sel" not in theirs["training"]
    assert theirs["model"]["descriptor"]["precision"] == "float32"
    assert "stat_file" in config["training"]  # the input itself is untouched


@pytest.mark.slow
def test_paired_first_epoch_steps(tmp_path):
    inp = make_project(tmp_path)
    result = first_epoch.paired_steps(str(inp), 3, 1, [0, 2], steady=True)
    assert set(result) == {"0", "2", "cached"}
    for figures in result.values():
        assert figures["wall_s"] > 0 and figures["thread_cpu_s"] > 0
        assert figures["thread_waits"] >= 0
    assert result["cached"]["lists_built"] == 0  # every list in the cache before its steps
    assert result["0"]["lists_built"] > 0


def test_steady_copies_cut_every_system_to_its_first_frames(tmp_path):
    inp = make_project(tmp_path)
    config = json.loads(inp.read_text())
    dest = first_epoch.truncated_copy(config, str(tmp_path), 2, str(tmp_path / "cut"))
    for name in ("training_data", "validation_data"):
        for path in config["training"][name]["systems"]:
            source, cut = tmp_path / path, tmp_path / "cut" / path
            assert (cut / "type.raw").read_text() == (source / "type.raw").read_text()
            for array in (source / "set.000").glob("*.npy"):
                whole, kept = np.load(array), np.load(cut / "set.000" / array.name)
                assert len(whole) > 2 and np.array_equal(kept, whole[:2])
    assert dest == str(tmp_path / "cut")


def test_floor_counts_and_table(tmp_path):
    inp = make_project(tmp_path)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"]["sel"] = [16, 28]
    inp.write_text(json.dumps(config))
    result = step_floor.run(str(tmp_path), "float64", 2, 0)
    parts = result["parts"]
    assert list(parts) == list(step_floor.PARTS)
    real = result["real_neighbours"]
    # embedding [4, 8] from one input, value and dG/ds, then T (4 x 8 per row)
    per_row = 2 * (1 * 4 + 4 * 8)
    embedding = parts["embedding nets + contraction (value, dG/ds, T)"]
    assert embedding["flop_needed"] == real * (2 * per_row + 2 * 4 * 8)
    assert embedding["flop_evaluated"] >= embedding["flop_needed"]
    # fitting [16, 16] from 8 x 4 descriptor columns: the value, and dE/dD without the last
    # layer's vector product
    value = 2 * (32 * 16 + 16 * 16 + 16 * 1)
    fitting = parts["fitting net (value, dE/dD)"]
    assert fitting["flop_needed"] == result["natoms"] * (value + value - 2 * 16)
    assert all(p["floor_s"] >= 0 and p["measured_s"] >= 0 for p in parts.values())
    assert sum(p["measured_s"] for p in parts.values()) > 0
    assert "| whole step |" in step_floor.table(result)
