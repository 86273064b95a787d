"""The scale benchmarks' own parts, on tiny generated data: the inputs that
benchmarks/startup.py, benchmarks/small_cells.py and benchmarks/memory_scaling.py write are
valid for mdtrain (small_cells.py's data and labels too), the log-line parsing finds the
first step, and benchmarks/pack_read.py's measuring child reads every form (figures checked
for sign only, never for speed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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


def test_small_cells_data_and_input_are_valid(tmp_path):
    """benchmarks/small_cells.py: fcc cells of 4 to 32 atoms shorter than 2·rcut, labels
    that are derivatives of the energy, and an input mdtrain accepts (rcut 5 Å)."""
    small = benchmark_module("small_cells")
    assert small.main(["make", str(tmp_path / "data"), "--systems", "6", "--seed", "3"]) == 0
    path = small.write_input(str(tmp_path / "data"), str(tmp_path), rcut=small.RCUT)
    config = json.loads(Path(path).read_text())
    report = check_config(config, path)
    assert report.problems == [] and (report.nsystems, report.nframes) == (6, 12)
    assert config["model"]["descriptor"]["rcut"] == 5.0
    from mdtrain.data import expand_systems, open_system

    for system in (open_system(p) for p in expand_systems(str(tmp_path / "data"))):
        frames = system.frames(np.arange(system.nframes))
        heights = 1.0 / np.linalg.norm(np.linalg.inv(frames["box"]), axis=1)
        assert system.natoms in (4, 8, 16, 32) and (heights < 2 * small.RCUT).all()
    # forces and virial are derivatives of the energy (central differences)
    reps, types, elements = small.system_cells(3, 0)
    model_types = np.array([small.TYPE_MAP.index(e) for e in elements])[types]
    data = small.frames(reps, model_types, np.random.default_rng(1), 1)
    coord, box = data["coord"][0], data["box"][0]
    energy, force, virial = small.morse_by_images(coord, box, model_types)
    h, atom = 1e-5, 1
    for axis in range(3):
        step = np.zeros_like(coord)
        step[atom, axis] = h
        up = small.morse_by_images(coord + step, box, model_types)[0]
        down = small.morse_by_images(coord - step, box, model_types)[0]
        assert -(up - down) / (2 * h) == pytest.approx(force[atom, axis], abs=1e-7)
    strain = np.zeros((3, 3))
    strain[0, 1] = h
    up = small.morse_by_images(coord @ (np.eye(3) + strain), box @ (np.eye(3) + strain),
                               model_types)[0]  # fmt: skip
    down = small.morse_by_images(coord @ (np.eye(3) - strain), box @ (np.eye(3) - strain),
                                 model_types)[0]  # fmt: skip
    assert -(up - down) / (2 * h) == pytest.approx(virial[0, 1], abs=1e-6)
    assert energy == pytest.approx(data["energy"][0], rel=1e-12)
