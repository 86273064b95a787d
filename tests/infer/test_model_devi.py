"""``mdtrain model-devi``: the file equals deviations computed here, independently, from each
model evaluated alone (its own neighbour list, one frame at a time; tests/helpers/committee.py
writes out DeePMD-kit's definitions with explicit loops), to the printed precision; its
header and number format are DeePMD-kit 3.2's, copied from its output. Models of every kind
(checkpoint, frozen .pth, .dp, a committee folder), one with another rcut and sel; systems
in deepmd/npy (atoms not sorted by type, several sets) and HDF5 (non-periodic); neighbour
lists built once per (rcut, sel); chunks after a simulated out-of-memory give the same file.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.errors import MDTrainError
from mdtrain.infer.committee import committee_members, load_committee
from mdtrain.infer.deviation import model_devi_header, model_devi_rows
from mdtrain.infer.model_devi import (
    committee_model_devi,
    deviation_of,
    evaluate_committee,
    frame_steps,
    neighbor_groups,
    trust_counts,
)
from mdtrain.memory import InferenceChunker
from mdtrain.neighbors import layout as layout_module
from tests.helpers.committee import (
    DEEPMD_ATOMIC_HEADER,
    DEEPMD_HEADER,
    DEEPMD_ROW,
    assert_printed_equal,
    committee_folder,
    member_model,
    read_model_devi,
    reference_deviation,
    write_model,
)
from tests.helpers.datagen import random_water_like, write_hdf5_system, write_npy_system
from tests.helpers.models import TINY_CONFIG, evaluate, tiny_model
from tests.helpers.placement import OTHER, OtherDevice
from tests.helpers.trajectories import write_extxyz, write_lammps_dump

TYPE_MAP = ["O", "H"]


@pytest.fixture(scope="module")
def members():
    """Three members of one architecture and a fourth with another rcut and sel."""
    return [member_model(k) for k in range(3)] + [member_model(3, rcut=3.5, sel=[12, 24])]


@pytest.fixture(scope="module")
def files(members, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    kinds = ["m0.pt", "m1.pth", "m2.dp", "m3.pt"]
    return [write_model(model, root / name) for model, name in zip(members, kinds)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Raw frames (atoms in the file's order: O H H O H H ...) and the systems holding them."""
    root = tmp_path_factory.mktemp("data")
    coords, types, boxes = random_water_like(5, 8, 6.5, seed=3, triclinic=True)
    periodic = write_npy_system(root / "water", coords, types, TYPE_MAP, boxes, set_size=2)
    c2, t2, _ = random_water_like(3, 8, 6.5, seed=4)
    cluster = write_hdf5_system(root / "more.h5", "cluster", c2, t2, TYPE_MAP, None)
    return {
        periodic: (coords, types, boxes),
        cluster: (c2, t2, None),
    }


def reference_rows(models, coords, types, boxes, relative=None, relative_v=None):
    """Each frame's row from each model evaluated alone on that frame."""
    rows = []
    for f in range(len(coords)):
        box = None if boxes is None else boxes[f]
        outs = [evaluate(model, coords[f], box, types) for model in models]
        rows.append(
            reference_deviation(
                np.array([float(o["energy"]) for o in outs]),
                np.stack([o["force"] for o in outs]),
                np.stack([o["virial"] for o in outs]),
                relative,
                relative_v,
            )
        )
    return np.array(rows)


def test_file_equals_independent_deviations(members, files, data, tmp_path):
    out = tmp_path / "model_devi.out"
    systems = list(data)
    assert main(["model-devi", "-m", *files, "-s", *systems, "-o", str(out), "--atomic"]) == 0
    blocks = read_model_devi(out)
    assert [title for title, _, _ in blocks] == systems
    for (_, names, rows), (coords, types, boxes) in zip(blocks, data.values()):
        assert names == DEEPMD_ATOMIC_HEADER
        assert rows.shape == (len(coords), 8 + len(types))
        np.testing.assert_array_equal(rows[:, 0], np.arange(len(coords)))
        assert_printed_equal(rows[:, 1:], reference_rows(members, coords, types, boxes))
    # the same without --atomic: the seven columns only, DeePMD's plain header
    plain = tmp_path / "plain.out"
    assert main(["model-devi", "-m", *files, "-s", systems[0], "-o", str(plain)]) == 0
    ((_, names, rows),) = read_model_devi(plain)
    assert names == DEEPMD_HEADER and rows.shape == (5, 8)
    np.testing.assert_array_equal(rows, blocks[0][2][:, :8])


def test_relative_frequency_and_committee_folder(members, data, tmp_path):
    folder = committee_folder(tmp_path / "committee", members[:3])
    system = next(iter(data))
    coords, types, boxes = data[system]
    out = tmp_path / "rel.out"
    args = ["-s", system, "-o", str(out), "-f", "10", "--relative", "1.0", "--relative-v", "0.5"]
    assert main(["model-devi", "-m", folder, *args, "--atomic"]) == 0
    ((_, _, rows),) = read_model_devi(out)
    np.testing.assert_array_equal(rows[:, 0], 10 * np.arange(len(coords)))
    expected = reference_rows(members[:3], coords, types, boxes, relative=1.0, relative_v=0.5)
    assert_printed_equal(rows[:, 1:], expected)
    # the relative columns are not the absolute ones: the option was applied
    absolute = reference_rows(members[:3], coords, types, boxes)
    assert np.all(np.abs(expected[:, 3] - absolute[:, 3]) > 1e-3)
    # DeePMD's spelling of the virial option is accepted too
    again = tmp_path / "again.out"
    spelled = [*args[:2], "-o", str(again), *args[4:-2], "--relative_v", "0.5", "--atomic"]
    assert main(["model-devi", "-m", folder, *spelled]) == 0
    assert again.read_text() == out.read_text()


def test_header_and_rows_are_deepmd_s():
    header = model_devi_header("sys/a").splitlines()
    assert header == ["# sys/a", DEEPMD_HEADER]
    assert model_devi_header("x", atomic=True).splitlines()[1] == DEEPMD_ATOMIC_HEADER
    values = np.array([[float(v) for v in DEEPMD_ROW.split()[1:]]])
    assert model_devi_rows(np.array([0]), values) == DEEPMD_ROW + "\n"
    assert model_devi_rows(np.array([123456]), np.array([[0.0, -1.5e-120]])) == (
        "      123456       0.000000e+00     -1.500000e-120\n"
    )


def test_neighbor_lists_are_built_once_per_rcut_and_sel(members, data, monkeypatch):
    assert [g[3] for g in neighbor_groups(members)] == [[0, 1, 2], [3]]
    calls = []
    real = layout_module.build_nlist

    def counting(coord, box, atype, rcut, sel):
        calls.append((rcut, tuple(sel)))
        return real(coord, box, atype, rcut, sel)

    monkeypatch.setattr(layout_module, "build_nlist", counting)
    system = open_system(next(iter(data)), TYPE_MAP)
    evaluate_committee(members, system)
    assert sorted(set(calls)) == [(3.5, (12, 24)), (4.0, (16, 32))]
    assert len(calls) == 2 * system.nframes


class RunsOutOfMemory(torch.nn.Module):
    """A model that raises CUDA's out-of-memory error on chunks of more than one frame."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.type_map, self.rcut, self.sel = model.type_map, model.rcut, model.sel
        self.failures = 0

    def forward(self, coord, *rest):
        if coord.shape[0] > 1:
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.model(coord, *rest)


def test_out_of_memory_chunks_give_the_same_numbers(members, data):
    system = open_system(next(iter(data)), TYPE_MAP)
    whole = evaluate_committee(members, system, chunker=InferenceChunker(start_atoms=10**6))
    flaky = RunsOutOfMemory(members[1])
    chunker = InferenceChunker(start_atoms=10**6)
    chunked = evaluate_committee([members[0], flaky, *members[2:]], system, chunker=chunker)
    assert flaky.failures > 0 and chunker.oom_count > 0
    for key in ("energy", "force", "virial"):
        np.testing.assert_allclose(
            getattr(chunked, key), getattr(whole, key), rtol=1e-12, atol=1e-12
        )


def test_chunked_deviations_equal_the_whole(members, data):
    system = open_system(next(iter(data)), TYPE_MAP)
    whole = deviation_of(evaluate_committee(members, system), relative=0.5)
    one_frame_chunks = InferenceChunker(start_atoms=1, max_atoms=1)
    chunked = committee_model_devi(members, system, chunker=one_frame_chunks, relative=0.5)
    np.testing.assert_allclose(chunked.columns(atomic=True), whole.columns(atomic=True), rtol=1e-12)


def test_forces_come_back_in_the_file_order(members, data):
    system_path = next(iter(data))
    coords, types, boxes = data[system_path]
    system = open_system(system_path, TYPE_MAP)
    assert not np.array_equal(system.atom_order, np.arange(len(types)))  # really reordered
    output = evaluate_committee(members[:2], system)
    direct = evaluate(members[1], coords[2], boxes[2], types)
    np.testing.assert_allclose(output.force[1, 2], direct["force"], atol=1e-10)
    assert deviation_of(output).atomic_force.shape == (5, len(types))


def test_evaluation_on_another_device_equals_the_cpu(files, data):
    system = open_system(next(iter(data)), TYPE_MAP)
    cpu_models, _ = load_committee(files[:3:2], "cpu")  # checkpoint and .dp
    expected = evaluate_committee(cpu_models, system)
    with OtherDevice():
        models, _ = load_committee(files[:3:2], OTHER)
        got = evaluate_committee(models, system, OTHER)
    for key in ("energy", "force", "virial"):
        np.testing.assert_allclose(
            getattr(got, key), getattr(expected, key), rtol=1e-12, atol=1e-12
        )


def test_steps_and_trust_counts(data):
    system = open_system(next(iter(data)), TYPE_MAP)
    np.testing.assert_array_equal(frame_steps(system), np.arange(5))
    np.testing.assert_array_equal(frame_steps(system, 7), 7 * np.arange(5))
    counts = trust_counts(np.array([0.01, 0.05, 0.1, 0.15, 0.3, 0.2]), 0.05, 0.2)
    assert counts == {"accurate": 1, "candidate": 3, "failed": 2}


def test_trust_levels_printed(files, data, tmp_path, capsys):
    out = tmp_path / "t.out"
    system = next(iter(data))
    assert main(["model-devi", "-m", *files[:2], "-s", system, "-o", str(out), "--trust-lo",
                 "0", "--trust-hi", "1e9"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "(accurate): 0" in printed and "(candidate): 5" in printed
    assert "(failed): 0" in printed


def test_committee_folder_members_in_numeric_order(members, tmp_path):
    root = tmp_path / "c"
    for k in (0, 1, 2, 10):
        write_model(members[0], root / f"member-{k}" / "model.ckpt.pt")
    (root / "member-x").mkdir()  # not a member
    found = committee_members(root)
    assert [p.split("/")[-2] for p in found] == ["member-0", "member-1", "member-2", "member-10"]
    single = tmp_path / "run"
    write_model(members[0], single / "model.ckpt.pt")
    assert committee_members(single) == [str(single / "model.ckpt.pt")]
    (root / "member-11").mkdir()
    with pytest.raises(MDTrainError, match=r"member-11/model.ckpt.pt not found"):
        committee_members(root)
    with pytest.raises(MDTrainError, match="neither member-"):
        committee_members(tmp_path / "c" / "member-x")


def test_bad_committees_and_options(members, files, data, tmp_path):
    system = next(iter(data))
    out = str(tmp_path / "x.out")
    with pytest.raises(MDTrainError, match="at least two models"):
        load_committee(files[:1])
    config = copy.deepcopy(TINY_CONFIG)
    config["type_map"] = ["H", "O"]
    odd = write_model(tiny_model(config=config), tmp_path / "odd.pt")
    with pytest.raises(MDTrainError, match=r"odd.pt: type_map \['H', 'O'\] differs"):
        load_committee([files[0], odd])
    assert main(["model-devi", "-m", files[0], "-s", system, "-o", out]) == 1
    for bad in (["--relative", "0"], ["-f", "0"], ["--trust-lo", "0.1"]):
        assert main(["model-devi", "-m", *files[:2], "-s", system, "-o", out, *bad]) == 1


def test_trajectories_give_the_numbers_of_their_frames(members, files, tmp_path):
    coords, types, boxes = random_water_like(3, 8, 6.5, seed=12)
    dump = write_lammps_dump(tmp_path / "md.dump", coords, types, boxes, [1000, 1010, 1020])
    xyz = write_extxyz(tmp_path / "md.extxyz", coords, [["OH"[t] for t in types]] * 3, boxes)
    out = tmp_path / "traj.out"
    assert main(["model-devi", "-m", *files[:3], "-s", dump, xyz, "-o", str(out), "--atomic"]) == 0
    (dump_title, _, dump_rows), (xyz_title, _, xyz_rows) = read_model_devi(out)
    assert (dump_title, xyz_title) == (dump, xyz)
    np.testing.assert_array_equal(dump_rows[:, 0], [1000, 1010, 1020])  # the dump's timesteps
    np.testing.assert_array_equal(xyz_rows[:, 0], [0, 1, 2])
    expected = reference_rows(members[:3], coords, types, boxes)
    assert_printed_equal(dump_rows[:, 1:], expected)
    assert_printed_equal(xyz_rows[:, 1:], expected)
    # -f replaces the timesteps by frame index x frequency, as dp model-devi counts
    assert main(["model-devi", "-m", *files[:3], "-s", dump, "-o", str(out), "-f", "5"]) == 0
    np.testing.assert_array_equal(read_model_devi(out)[0][2][:, 0], [0, 5, 10])
