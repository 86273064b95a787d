"""benchmarks/make_dataset.py: the synthetic data sets are valid for ``mdtrain check``, the
same in deepmd/npy and deepmd/hdf5, physically sane, and labelled consistently (checked
against the independent pair-potential code of tests/helpers/datagen.py and by finite
differences)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mdtrain.check import check_config
from mdtrain.data import expand_systems, open_system
from mdtrain.neighbors.stat import compute_neighbor_stat
from tests.helpers.benchmarks import benchmark_module
from tests.helpers.datagen import lj_labels

make_dataset = benchmark_module("make_dataset")
lattice = benchmark_module("lattice_data")


def _input(systems: str) -> dict:
    return {
        "model": {
            "type_map": lattice.TYPE_MAP,
            "descriptor": {"type": "se_e2_a", "sel": "auto", "rcut": 4.0, "rcut_smth": 0.5,
                           "neuron": [4, 8], "axis_neuron": 4},
            "fitting_net": {"neuron": [8]},
        },
        "learning_rate": {"start_lr": 1e-3, "stop_lr": 1e-5},
        "loss": {},
        "training": {"training_data": {"systems": [systems], "batch_size": 1}, "numb_steps": 1},
    }  # fmt: skip


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The same data set (4 systems × 7 frames, 3 frames per set) as folders and as HDF5."""
    root = tmp_path_factory.mktemp("generated")
    args = ["--systems", "4", "--frames", "7", "--set-size", "3", "--atoms", "4", "40",
            "--seed", "5"]  # fmt: skip
    assert make_dataset.main([str(root / "npy"), *args, "--json", str(root / "npy.json")]) == 0
    assert make_dataset.main([str(root / "data.h5"), *args]) == 0
    return root


@pytest.mark.parametrize("name", ["npy", "data.h5"])
def test_mdtrain_check_accepts_it(written, name):
    report = check_config(_input(str(written / name)), str(written / "input.json"))
    assert report.problems == []
    assert (report.nsystems, report.nframes) == (4, 28)


def test_npy_and_hdf5_hold_the_same_frames(written):
    summary = json.loads((written / "npy.json").read_text())
    assert (summary["systems"], summary["frames_per_system"]) == (4, 7)
    folders = expand_systems(str(written / "npy"))
    groups = expand_systems(str(written / "data.h5"))
    assert len(folders) == len(groups) == 4
    for a, b in zip(folders, groups, strict=True):
        sa, sb = open_system(a, lattice.TYPE_MAP), open_system(b, lattice.TYPE_MAP)
        assert [s.nframes for s in sa.sets] == [3, 3, 1]
        np.testing.assert_array_equal(sa.atype, sb.atype)
        fa, fb = sa.frames(np.arange(7)), sb.frames(np.arange(7))
        assert set(fa) == {"coord", "box", "energy", "force", "virial"} == set(fb)
        for key in fa:
            np.testing.assert_array_equal(fa[key], fb[key])


def test_frames_are_physically_sane(written):
    systems = [open_system(p, lattice.TYPE_MAP) for p in expand_systems(str(written / "npy"))]
    assert len({s.natoms for s in systems}) > 1  # several sizes
    assert len({tuple(np.unique(s.atype)) for s in systems}) > 1  # several compositions
    stat = compute_neighbor_stat(systems, 5.0, 3, progress=False)
    assert 1.5 < stat.min_nbor_dist < 2.5  # no overlap, yet a dense solid


def test_labels_are_the_pair_potential_and_its_derivatives(written):
    system = open_system(expand_systems(str(written / "npy"))[2], lattice.TYPE_MAP)
    frame = system.frames([4])
    types = system.atype  # indices into TYPE_MAP, atoms sorted by type
    coord, box = frame["coord"][0], frame["box"][0]

    def pair_energy(c, b):
        energy, force, virial = lj_labels(
            c[None], types, b[None], lattice.RCUT, lattice.RCUT_SMTH, lattice.pair_params()
        )
        return energy[0], force[0], virial[0]

    energy, force, virial = pair_energy(coord, box)
    constant = lattice.ATOM_ENERGY[types].sum()
    assert frame["energy"][0] == pytest.approx(energy + constant, abs=1e-9)
    np.testing.assert_allclose(frame["force"][0], force, atol=1e-10)
    np.testing.assert_allclose(frame["virial"][0], virial, atol=1e-9)
    assert np.abs(force).max() > 0.05 and np.abs(virial).max() > 0.05
    h = 1e-5  # force = -dE/dr and W = -dE/dε, by central differences of the stored energy
    for atom, axis in [(0, 0), (3, 1), (len(types) - 1, 2)]:
        plus, minus = coord.copy(), coord.copy()
        plus[atom, axis] += h
        minus[atom, axis] -= h
        fd = -(pair_energy(plus, box)[0] - pair_energy(minus, box)[0]) / (2 * h)
        assert frame["force"][0, atom, axis] == pytest.approx(fd, abs=1e-6)
    strain = np.eye(3)
    strain[0, 1] = strain[1, 0] = h / 2
    e_plus = pair_energy(coord @ strain, box @ strain)[0]
    strain[0, 1] = strain[1, 0] = -h / 2
    e_minus = pair_energy(coord @ strain, box @ strain)[0]
    fd_shear = -(e_plus - e_minus) / (2 * h)
    assert frame["virial"][0, 0, 1] == pytest.approx(fd_shear, abs=1e-6)


def test_sizes_from_a_target_and_shared_systems():
    specs, frames = make_dataset.plan(5, None, 0.01, (20, 60), seed=3)
    total = frames * sum(lattice.frame_bytes(s.natoms) for s in specs)
    assert len(specs) == 5 and 1e7 <= total < 1e7 + sum(lattice.frame_bytes(60) for _ in specs)
    more, few = make_dataset.plan(None, 2, 0.001, (20, 60), seed=3)
    assert few == 2 and len(more) > 5
    for a, b in zip(specs, more, strict=False):  # system i depends on the seed and i only
        assert a.natoms == b.natoms and a.elements == b.elements
        np.testing.assert_array_equal(a.types, b.types)
