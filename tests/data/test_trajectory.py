"""Trajectories for evaluation (``mdtrain.data.trajectory``): runs of frames with fixed atoms,
LAMMPS dump types named by a type map, dump timesteps, and deepmd systems beside them."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.data import System
from mdtrain.data.trajectory import (
    TrajectoryFrames,
    lammps_dump_timesteps,
    open_frame_sources,
    read_trajectory,
)
from mdtrain.errors import MDTrainError
from tests.helpers.datagen import random_water_like, write_npy_system
from tests.helpers.trajectories import write_extxyz, write_lammps_dump

TYPE_MAP = ["O", "H"]


@pytest.fixture
def frames():
    coords, types, boxes = random_water_like(4, 8, 6.5, seed=11)
    return coords, types, boxes


def test_extxyz_is_cut_into_runs_of_fixed_atoms(frames, tmp_path):
    coords, types, boxes = frames
    water = ["OH"[t] for t in types]
    swapped = water[1:] + water[:1]  # other order of the same atoms: another run
    path = write_extxyz(
        tmp_path / "t.extxyz",
        coords,
        [water, water, swapped, water],
        [boxes[0], boxes[1], boxes[2], None],  # the last frame non-periodic
    )
    runs = read_trajectory(path, "auto", TYPE_MAP)
    assert [(r.path, r.first, r.nframes, r.periodic) for r in runs] == [
        (f"{path}[0:2]", 0, 2, True),
        (f"{path}[2:3]", 2, 1, True),
        (f"{path}[3:4]", 3, 1, False),
    ]
    np.testing.assert_array_equal(runs[0].atype, types)
    np.testing.assert_array_equal(runs[1].atype, np.roll(types, -1))
    np.testing.assert_array_equal(runs[0].atom_order, np.arange(len(types)))
    np.testing.assert_allclose(runs[0].frames([1])["coord"][0], coords[1], atol=1e-7)
    np.testing.assert_allclose(runs[0].frames([1])["box"][0], boxes[1], atol=1e-7)
    assert "box" not in runs[2].frames([0]) and runs[0].timesteps is None


def test_lammps_dump_types_and_timesteps(frames, tmp_path):
    coords, types, boxes = frames
    path = write_lammps_dump(tmp_path / "md.dump", coords, types, boxes, [0, 50, 100, 150])
    np.testing.assert_array_equal(lammps_dump_timesteps(path), [0, 50, 100, 150])
    (run,) = read_trajectory(path, "auto", TYPE_MAP)  # dump type 1 = the model's first type
    assert run.path == path and run.nframes == 4
    np.testing.assert_array_equal(run.timesteps, [0, 50, 100, 150])
    np.testing.assert_array_equal(run.atype, types)  # atoms back in id order
    # dpdata moves the box origin to zero: compare distances, not positions
    got = run.frames([2])["coord"][0]
    np.testing.assert_allclose(got - got[0], coords[2] - coords[2][0], atol=1e-9)
    # -t names the dump types: type 1 is H here, so the model types swap
    (swapped,) = read_trajectory(path, "auto", TYPE_MAP, ["H", "O"])
    np.testing.assert_array_equal(swapped.atype, 1 - types)
    with pytest.raises(MDTrainError, match=r"element H is not in the model type_map \['O'\]"):
        read_trajectory(path, "auto", ["O"], ["O", "H"])


def test_deepmd_systems_and_trajectories_together(frames, tmp_path):
    coords, types, boxes = frames
    system = write_npy_system(tmp_path / "data" / "sys", coords, types, TYPE_MAP, boxes)
    dump = write_lammps_dump(tmp_path / "md.lammpstrj", coords, types, boxes, [1, 2, 3, 4])
    sources = open_frame_sources([str(tmp_path / "data"), dump], TYPE_MAP)
    assert isinstance(sources[0], System) and sources[0].path == system
    assert isinstance(sources[1], TrajectoryFrames) and sources[1].nframes == 4
    assert lammps_dump_timesteps(system + "/type.raw") is None
