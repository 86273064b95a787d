"""The scale benchmarks' own parts, on tiny generated data: the inputs that
benchmarks/startup.py and benchmarks/memory_scaling.py write are valid for mdtrain, the
log-line parsing finds the first step, and benchmarks/pack_read.py's measuring child reads
every form (figures checked for sign only, never for speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mdtrain.check import check_config
from tests.helpers.benchmarks import benchmark_module

make_dataset = benchmark_module("make_dataset")
startup = benchmark_module("startup")
scaling = benchmark_module("memory_scaling")
pack_read = benchmark_module("pack_read")
children = benchmark_module("neighbor_stat")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    assert make_dataset.main([str(root / "npy"), "--systems", "3", "--frames", "4",
                              "--atoms", "8", "30", "--seed", "2"]) == 0  # fmt: skip
    return root


def test_the_inputs_written_are_valid(data, tmp_path):
    path = startup.write_input(str(data / "npy"), str(tmp_path))
    config = json.loads(Path(path).read_text())
    report = check_config(config, path)
    assert report.problems == [] and (report.nsystems, report.nframes) == (3, 12)
    assert config["training"]["numb_steps"] == 1 and config["model"]["descriptor"]["sel"] == "auto"
    scaling.make_input(str(data / "npy"), 30, str(tmp_path / "scaling.json"))
    config = json.loads((tmp_path / "scaling.json").read_text())
    assert check_config(config, str(tmp_path / "scaling.json")).problems == []
    assert config["training"]["numb_steps"] == 30


def test_first_step_found_in_either_log():
    lines = [(1.0, "INFO model: 10 parameters; training for 1 steps"),
             (2.5, "INFO step 1/1  rmse 3.1e+00  lr 1.0e-03"),
             (3.0, "[t] DEEPMD INFO    Batch       1: trn: rmse = 9.44e-01")]  # fmt: skip
    run = children.ChildRun(["x"], 0, 4.0, 3.0, 100.0, lines)
    assert startup._arrival(run, startup.MDTRAIN_STEP) == 2.5
    assert startup._arrival(run, startup.DP_STEP) == 3.0
    with pytest.raises(children.ChildFailed, match="no line matching"):
        startup._arrival(children.ChildRun(["x"], 0, 1.0, 1.0, 1.0, lines[:1]), startup.DP_STEP)


def test_pack_read_child_reads_folders_and_packed_file(data, tmp_path):
    from mdtrain.cli import main

    packed = tmp_path / "packed.h5"
    assert main(["convert", "--pack", str(data / "npy"), "-o", str(packed)]) == 0
    for source in (data / "npy", packed):
        figures = pack_read._child(str(source), batches=20, batch_size=2)
        assert figures["scan_frames_per_s"] > 0 and figures["random_batches_per_s"] > 0
