"""Neighbour statistics, the neighbor_stat.json file and the ``mdtrain neighbor-stat`` command.

References are independent of the code under test: a brute-force loop over periodic images
(``tests.helpers.reference.brute_force_pairs``) and ASE's ``primitive_neighbor_list``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from ase.neighborlist import primitive_neighbor_list

from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.errors import MDTrainError
from mdtrain.neighbors import stat as stat_module
from mdtrain.neighbors import stat_count
from mdtrain.neighbors.sel import auto_sel, parse_sel, resolve_sel
from mdtrain.neighbors.stat import compute_neighbor_stat
from mdtrain.neighbors.stat_file import (
    check_neighbor_stat_matches,
    load_neighbor_stat,
    write_neighbor_stat,
)
from tests.helpers.reference import brute_force_pairs, random_cell

TYPE_MAP = ["O", "H", "C"]


def write_system(path, coords, types, type_map, boxes=None) -> str:
    """A deepmd/npy system written with plain numpy (``boxes=None``: non-periodic)."""
    os.makedirs(os.path.join(path, "set.000"), exist_ok=True)
    np.savetxt(os.path.join(path, "type.raw"), types, fmt="%d")
    with open(os.path.join(path, "type_map.raw"), "w") as handle:
        handle.write("\n".join(type_map) + "\n")
    nframes = len(coords)
    np.save(os.path.join(path, "set.000", "coord.npy"), coords.reshape(nframes, -1))
    if boxes is None:
        open(os.path.join(path, "nopbc"), "w").close()
    else:
        np.save(os.path.join(path, "set.000", "box.npy"), boxes.reshape(nframes, 9))
    return str(path)


def random_frames(rng, nframes, natoms, cell_lengths, min_dist=0.7):
    """Random positions on a jittered grid (no two atoms closer than ``min_dist``, images
    included) in random triclinic cells; some atoms moved by whole cells (not wrapped)."""
    coords, boxes = [], []
    for _ in range(nframes):
        while True:
            cell = random_cell(rng, cell_lengths, tilt=0.15)
            shape = [max(1, int(length / 1.5)) for length in cell_lengths]
            sites = np.stack(np.meshgrid(*map(np.arange, shape), indexing="ij"), -1).reshape(-1, 3)
            assert len(sites) >= natoms
            frac = (sites[rng.permutation(len(sites))[:natoms]] + 0.5) / shape
            frac += rng.uniform(-0.15, 0.15, size=frac.shape) / shape
            frac += rng.integers(-1, 2, size=frac.shape) * (rng.random(frac.shape) < 0.2)
            coord = frac @ cell
            if not brute_force_pairs(coord, cell, min_dist):
                break
        coords.append(coord)
        boxes.append(cell)
    return np.array(coords), np.array(boxes)


def reference_stat(coords, boxes, types, rcut, ntypes):
    """(min distance, per-type max count, max count of all types together) by brute force
    over images, in the file's atom order."""
    min_dist, max_counts, max_total = np.inf, np.zeros(ntypes, dtype=int), 0
    for f in range(len(coords)):
        box = None if boxes is None else boxes[f]
        counts = np.zeros((len(types), ntypes), dtype=int)
        for i, j, *_, d in brute_force_pairs(coords[f], box, rcut):
            counts[i, types[j]] += 1
            min_dist = min(min_dist, d)
        max_counts = np.maximum(max_counts, counts.max(axis=0))
        max_total = max(max_total, int(counts.sum(axis=1).max()))
    return min_dist, max_counts.tolist(), max_total


@pytest.fixture
def mixed_systems(tmp_path):
    """Three systems of different sizes, compositions and cells; with their references."""
    rng = np.random.default_rng(7)
    rcut = 3.5
    specs = {
        # cell shorter than rcut in one direction: own images are neighbours
        "thin": dict(natoms=5, lengths=(2.6, 6.0, 7.5), types=[1, 0, 1, 1, 0], names=["O", "H"]),
        # shorter than 2·rcut: several images of one neighbour
        "mid": dict(natoms=9, lengths=(5.0, 6.5, 6.0), types=[0, 2, 1, 1, 0, 2, 1, 1, 1],
                    names=["O", "H", "C"]),
    }  # fmt: skip
    systems = {}
    for name, spec in specs.items():
        coords, boxes = random_frames(rng, 3, spec["natoms"], spec["lengths"])
        types = np.array(spec["types"])
        path = write_system(tmp_path / name, coords, types, spec["names"], boxes)
        model_types = np.array([TYPE_MAP.index(spec["names"][t]) for t in types])
        systems[name] = (path, reference_stat(coords, boxes, model_types, rcut, 3))
    # a non-periodic cluster with only hydrogens
    coords = np.stack([rng.uniform(0, 4.0, size=(6, 3)) + 0.4 * k for k in range(4)])
    coords[:, 1] = coords[:, 0] + [0.9, 0.0, 0.0]  # keeps a close pair
    path = write_system(tmp_path / "cluster", coords, np.zeros(6, dtype=int), ["H"])
    systems["cluster"] = (path, reference_stat(coords, None, np.ones(6, dtype=int), rcut, 3))
    return rcut, systems


@pytest.mark.parametrize(
    "threads, settle, windows", [(1, 1, False), (1, 1 << 16, False), (3, 50, False),
                                 (1, 0, True), (3, 0, True)]
)  # fmt: skip
def test_mixed_systems_match_brute_force(mixed_systems, threads, settle, windows, monkeypatch):
    """Both counting paths: whole windows at once, and frame by frame (``count_chunk``,
    several frames counted together up to ``settle`` pairs)."""
    rcut, systems = mixed_systems
    opened = [open_system(path, TYPE_MAP) for path, _ in systems.values()]
    if threads > 1:
        monkeypatch.setattr(stat_module, "_THREADED_MIN_ATOMS", 1)  # threads for tiny frames
    if not windows:
        monkeypatch.setattr(stat_module, "count_window", lambda *args: None)
        monkeypatch.setattr(stat_count, "PAIRS_PER_SETTLE", settle)  # frames counted together
    stat = compute_neighbor_stat(opened, rcut, len(TYPE_MAP), progress=False, threads=threads)
    refs = [ref for _, ref in systems.values()]
    for result, (ref_min, ref_max, ref_total) in zip(stat.systems, refs, strict=True):
        assert result.min_nbor_dist == pytest.approx(ref_min, rel=1e-12)
        assert result.max_nbor_size == ref_max
        assert result.max_nbor_total == ref_total  # all types together
    assert stat.max_nbor_total == max(r[2] for r in refs)
    assert stat.min_nbor_dist == pytest.approx(min(r[0] for r in refs), rel=1e-12)
    assert stat.max_nbor_size == np.max([r[1] for r in refs], axis=0).tolist()
    assert stat.systems[2].max_nbor_size[0] == 0  # the cluster has no oxygen
    assert stat.systems[0].max_nbor_size[2] == 0  # "thin" has no carbon


def test_larger_system_matches_ase(tmp_path):
    rng = np.random.default_rng(3)
    rcut, natoms = 4.0, 60
    coords, boxes = random_frames(rng, 2, natoms, (7.0, 8.0, 9.0), min_dist=1.0)
    types = rng.integers(0, 2, size=natoms)
    system = open_system(write_system(tmp_path / "s", coords, types, ["O", "H"], boxes), ["O", "H"])
    stat = compute_neighbor_stat([system], rcut, 2, progress=False)
    ref_min, ref_max = np.inf, np.zeros(2, dtype=int)
    for coord, box in zip(coords, boxes, strict=True):
        i, j, d = primitive_neighbor_list("ijd", [True] * 3, box, coord, rcut)
        keep = d < rcut
        counts = np.zeros((natoms, 2), dtype=int)
        np.add.at(counts, (i[keep], types[j[keep]]), 1)
        ref_max = np.maximum(ref_max, counts.max(axis=0))
        ref_min = min(ref_min, d.min())
    assert stat.min_nbor_dist == pytest.approx(ref_min, rel=1e-12)
    assert stat.max_nbor_size == ref_max.tolist()


def test_own_images_are_counted_in_cells_shorter_than_rcut(tmp_path):
    rng = np.random.default_rng(2)
    coords, boxes = random_frames(rng, 2, 2, (2.0, 2.4, 3.1), min_dist=0.5)
    types = np.array([0, 0])  # same type: own images and the other atom add up
    path = write_system(tmp_path / "tiny", coords, types, ["O", "H"], boxes)
    stat = compute_neighbor_stat([open_system(path, ["O", "H"])], 3.5, 2, progress=False)
    ref_min, ref_max, _ = reference_stat(coords, boxes, types, 3.5, 2)
    assert stat.max_nbor_size == ref_max and ref_max[0] > 10  # many images of each atom
    assert stat.min_nbor_dist == pytest.approx(ref_min, rel=1e-12)


def test_counts_use_a_strict_cutoff(tmp_path):
    coords = np.array([[[0.0, 0, 0], [2.0, 0, 0], [0, 1.9, 0]]])
    system = open_system(write_system(tmp_path / "s", coords, [0, 0, 0], ["O"]), ["O"])
    stat = compute_neighbor_stat([system], 2.0, 1, progress=False)
    assert stat.max_nbor_size == [1]  # the pair at exactly 2.0 does not count
    assert stat.min_nbor_dist == pytest.approx(1.9)


# ----------------------------------------------------------------------------------------
# sel


@pytest.mark.parametrize(
    ("counts", "ratio", "expected"),
    [([46, 92], 1.1, [52, 104]), ([72], 1.1, [80]), ([38], 1.1, [44]), ([0, 1], 1.1, [0, 4]),
     ([10], 1.0, [12]), ([40], 1.0, [40]), ([46], 1.2, [56])],
)  # fmt: skip
def test_auto_sel_rule(counts, ratio, expected):
    assert auto_sel(counts, ratio) == expected


def test_parse_and_resolve_sel(log_records):
    assert parse_sel("auto") == 1.1
    assert parse_sel("auto:1.25") == 1.25
    assert parse_sel([46, 92]) == [46, 92]
    assert parse_sel(120) == 120  # one sel for all types (mixed-types descriptors)
    for bad in ("auto:x", "auto:-1", "full", [4.5, 2], [-1], 0, True):
        with pytest.raises(MDTrainError, match="sel"):
            parse_sel(bad)
    with pytest.raises(MDTrainError, match="only by descriptors with one type-mixed"):
        resolve_sel(120, [46, 50])
    assert resolve_sel("auto:1.2", [46]) == [56]
    assert resolve_sel([40, 0, 100], [46, 50, 90]) == [40, 0, 100]
    warnings = [r.getMessage() for r in log_records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sel[0] = 40" in warnings[0] and "46" in warnings[0]
    with pytest.raises(MDTrainError, match="2 types"):
        resolve_sel([40], [46, 50])


# ----------------------------------------------------------------------------------------
# errors and warnings


@pytest.fixture
def log_records():
    """Records of the ``mdtrain`` logger, whether or not it propagates to the root."""
    records: list[logging.LogRecord] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("mdtrain")
    handler = _Collect(level=logging.DEBUG)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_overlapping_atoms_name_system_and_frame(tmp_path):
    rng = np.random.default_rng(1)
    coords, boxes = random_frames(rng, 4, 6, (6.0, 6.0, 6.0))
    coords[2, 4] = coords[2, 1] + 1e-4  # frame 2: atoms 1 and 4 on top of each other
    coords[3, 5] = coords[3, 0]  # frame 3 too; the first one is reported
    path = write_system(tmp_path / "dup", coords, [0] * 6, ["O"], boxes)
    system = open_system(path, ["O"])
    with pytest.raises(MDTrainError, match=r"dup, frame 2: atoms [14] and [14] overlap"):
        compute_neighbor_stat([system], 3.0, 1, progress=False)


@pytest.mark.parametrize("overlap_frame, nan_frame", [(1, 3), (3, 1)])
def test_the_first_frame_with_a_problem_is_reported(tmp_path, overlap_frame, nan_frame):
    """Frames are searched one by one but counted together: an overlap found when they are
    counted still comes before a later frame's non-finite coordinates, and after an
    earlier one's."""
    rng = np.random.default_rng(2)
    coords, boxes = random_frames(rng, 5, 6, (6.0, 6.0, 6.0))
    coords[overlap_frame, 3] = coords[overlap_frame, 2]
    coords[nan_frame, 0, 1] = np.nan
    path = write_system(tmp_path / "two", coords, [0] * 6, ["O"], boxes)
    first = min(overlap_frame, nan_frame)
    what = "overlap" if first == overlap_frame else "not finite"
    with pytest.raises(MDTrainError, match=rf"two, frame {first}: .*{what}"):
        compute_neighbor_stat([open_system(path, ["O"])], 3.0, 1, progress=False)


def test_overlap_with_own_image_in_a_degenerate_cell(tmp_path):
    coords = np.zeros((2, 2, 3))
    coords[:, 1] = [1.5, 1.5, 1.5]
    boxes = np.repeat(np.diag([4.0, 4.0, 4.0])[None], 2, axis=0)
    boxes[1, 2] = [4.0, 4.0, 0.0]  # frame 1: the third vector lies in the plane of the others
    path = write_system(tmp_path / "flat", coords, [0, 0], ["O"], boxes)
    with pytest.raises(MDTrainError, match=r"flat, frame 1: the cell is degenerate"):
        compute_neighbor_stat([open_system(path, ["O"])], 3.0, 1, progress=False)


def test_types_beyond_type_map_are_an_error(tmp_path):
    coords = np.array([[[0.0, 0, 0], [1.0, 0, 0]]])
    path = write_system(tmp_path / "s", coords, [0, 1], ["O", "H"])
    system = open_system(path, None)
    with pytest.raises(MDTrainError, match="1 types"):
        compute_neighbor_stat([system], 3.0, 1, progress=False)


def test_atom_without_neighbour_warns_once_per_system(tmp_path, log_records):
    # two atoms 5 Å apart (rcut 3): every frame, one warning for the system
    coords = np.array([[[0.0, 0, 0], [5.0, 0, 0]], [[0.0, 0, 0], [0.0, 5.5, 0]]])
    far = write_system(tmp_path / "far", coords, [0, 0], ["O"])
    # a periodic frame where only atom 2 is isolated (frame 1), frame 0 is fine
    coords = np.array(
        [[[1.0, 1, 1], [2.0, 1, 1], [2.5, 1, 1]], [[1.0, 1, 1], [2.0, 1, 1], [6, 6, 6]]]
    )
    boxes = np.repeat(np.eye(3)[None] * 10.0, 2, axis=0)
    some = write_system(tmp_path / "some", coords, [0, 0, 0], ["O"], boxes)
    single = write_system(tmp_path / "single", np.zeros((1, 1, 3)), [0], ["O"])
    systems = [open_system(p, ["O"]) for p in (far, some, single)]
    stat = compute_neighbor_stat(systems, 3.0, 1, progress=False)
    warnings = [r.getMessage() for r in log_records if r.levelno == logging.WARNING]
    by_system = {name: [w for w in warnings if f"/{name}:" in w] for name in ("far", "some")}
    assert len(by_system["far"]) == 1 and len(by_system["some"]) == 1
    assert "frame 0; 2 of 2 frames" in by_system["far"][0]
    assert "frame 1; 1 of 2 frames" in by_system["some"][0]
    assert any("/single:" in w for w in warnings)
    # the smallest distance is exact even beyond rcut; a lone atom has none
    assert stat.systems[0].min_nbor_dist == pytest.approx(5.0)
    assert stat.systems[1].min_nbor_dist == pytest.approx(0.5)
    assert stat.systems[2].min_nbor_dist == np.inf
    content = write_neighbor_stat(str(tmp_path / "ns.json"), stat, ["O"])
    assert content["systems"][2]["min_nbor_dist"] is None


def test_isolated_atom_in_a_cell_sees_its_images(tmp_path):
    coords = np.zeros((1, 1, 3))
    boxes = np.diag([7.0, 8.0, 9.0])[None]
    path = write_system(tmp_path / "atom", coords, [0], ["O"], boxes)
    stat = compute_neighbor_stat([open_system(path, ["O"])], 3.0, 1, progress=False)
    assert stat.min_nbor_dist == pytest.approx(7.0) and stat.max_nbor_size == [0]


# ----------------------------------------------------------------------------------------
# the JSON file


@pytest.fixture
def two_systems(tmp_path):
    rng = np.random.default_rng(11)
    paths = []
    for k, natoms in enumerate((6, 9)):
        coords, boxes = random_frames(rng, 2, natoms, (6.0, 6.5, 7.0))
        types = rng.integers(0, 2, size=natoms)
        paths.append(write_system(tmp_path / "data" / f"sys{k}", coords, types, ["O", "H"], boxes))
    return paths


def test_json_contents(tmp_path, two_systems):
    systems = [open_system(p, ["O", "H"]) for p in two_systems]
    stat = compute_neighbor_stat(systems, 3.0, 2, progress=False)
    out = tmp_path / "out" / "ns.json"
    write_neighbor_stat(str(out), stat, ["O", "H"], sel_ratio=1.2)
    content = load_neighbor_stat(str(out))
    assert content["rcut"] == 3.0 and content["type_map"] == ["O", "H"]
    assert content["min_nbor_dist"] == stat.min_nbor_dist
    assert content["max_nbor_size"] == stat.max_nbor_size
    assert content["sel"] == auto_sel(stat.max_nbor_size, 1.2) and content["sel_ratio"] == 1.2
    assert [s["path"] for s in content["systems"]] == two_systems
    assert [s["nframes"] for s in content["systems"]] == [2, 2]
    assert [s["natoms"] for s in content["systems"]] == [6, 9]
    hashes = [s.fingerprint()["sha256"] for s in systems]
    assert [s["sha256"] for s in content["systems"]] == hashes
    assert content["fingerprint"] == hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()
    assert content["mdtrain_version"]
    assert os.listdir(out.parent) == ["ns.json"]  # the temporary file was renamed


def test_fingerprint_follows_the_data_not_the_paths(tmp_path, two_systems):
    def fingerprint(paths):
        systems = [open_system(p, ["O", "H"]) for p in paths]
        return compute_neighbor_stat(systems, 3.0, 2, progress=False).fingerprint

    reference = fingerprint(two_systems)
    assert fingerprint(two_systems[::-1]) == reference
    moved = shutil.copytree(os.path.dirname(two_systems[0]), tmp_path / "moved")
    assert fingerprint([os.path.join(moved, "sys0"), os.path.join(moved, "sys1")]) == reference
    coord_file = os.path.join(two_systems[1], "set.000", "coord.npy")
    coords = np.load(coord_file)
    coords[1, 0] += 0.01
    np.save(coord_file, coords)
    assert fingerprint(two_systems) != reference


def test_mismatch_detection(tmp_path, two_systems):
    systems = [open_system(p, ["O", "H"]) for p in two_systems]
    stat = compute_neighbor_stat(systems, 3.0, 2, progress=False)
    path = str(tmp_path / "ns.json")
    write_neighbor_stat(path, stat, ["O", "H"])
    content = load_neighbor_stat(path)
    check_neighbor_stat_matches(content, 3.0, ["O", "H"], systems)  # no error
    # the same data twice (a copy under another name) must match its own file too
    twin = shutil.copytree(two_systems[1], tmp_path / "twin")
    doubled = [*systems, open_system(str(twin), ["O", "H"])]
    write_neighbor_stat(str(tmp_path / "doubled.json"), compute_neighbor_stat(
        doubled, 3.0, 2, progress=False), ["O", "H"])  # fmt: skip
    doubled_content = load_neighbor_stat(str(tmp_path / "doubled.json"))
    check_neighbor_stat_matches(doubled_content, 3.0, ["O", "H"], doubled)
    with pytest.raises(MDTrainError, match="twin, which is not in the data now"):
        check_neighbor_stat_matches(doubled_content, 3.0, ["O", "H"], systems)
    with pytest.raises(MDTrainError, match=r"rcut = 3.0, not 3.5"):
        check_neighbor_stat_matches(content, 3.5, ["O", "H"], systems)
    with pytest.raises(MDTrainError, match=r"type_map \['O', 'H'\], not \['H', 'O'\]"):
        check_neighbor_stat_matches(content, 3.0, ["H", "O"], systems)
    with pytest.raises(MDTrainError, match="sys1, which is not in the data now"):
        check_neighbor_stat_matches(content, 3.0, ["O", "H"], systems[:1])
    coords = np.load(os.path.join(two_systems[1], "set.000", "coord.npy"))
    coords[0, 0] += 0.01
    changed = write_system(tmp_path / "changed", coords.reshape(2, -1, 3), np.loadtxt(
        os.path.join(two_systems[1], "type.raw"), dtype=int), ["O", "H"],
        np.load(os.path.join(two_systems[1], "set.000", "box.npy")).reshape(2, 3, 3))  # fmt: skip
    with pytest.raises(MDTrainError, match="system .*changed is not among the data"):
        check_neighbor_stat_matches(
            content, 3.0, ["O", "H"], [systems[0], open_system(changed, ["O", "H"])]
        )


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(MDTrainError, match="not found"):
        load_neighbor_stat(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"rcut": 6.0,\n "type_map": [}')
    with pytest.raises(MDTrainError, match=r"bad.json: not valid JSON \(line 2"):
        load_neighbor_stat(str(bad))
    bad.write_text(json.dumps({"rcut": 6.0}))
    with pytest.raises(MDTrainError, match="'type_map' missing"):
        load_neighbor_stat(str(bad))


# ----------------------------------------------------------------------------------------
# the command


def test_cli_system_form(tmp_path, two_systems, capsys):
    out = tmp_path / "stat.json"
    code = main(["neighbor-stat", "-s", *two_systems, "-r", "3", "-t", "O", "H", "-o", str(out)])
    assert code == 0
    content = json.loads(out.read_text())
    systems = [open_system(p, ["O", "H"]) for p in two_systems]
    stat = compute_neighbor_stat(systems, 3.0, 2, progress=False)
    assert content["max_nbor_size"] == stat.max_nbor_size
    printed = capsys.readouterr().out
    assert f"min_nbor_dist: {stat.min_nbor_dist:.6f}" in printed
    lines = {line.split()[0]: line.split() for line in printed.splitlines() if line.strip()}
    assert lines["O"][1:3] == [str(stat.max_nbor_size[0]), str(content["sel"][0])]
    assert lines["H"][1:3] == [str(stat.max_nbor_size[1]), str(content["sel"][1])]


def test_cli_input_form(tmp_path, two_systems, monkeypatch, capsys):
    config = {
        "model": {"type_map": ["O", "H"],
                  "descriptor": {"type": "se_a", "rcut": 3.0, "sel": "auto:1.3"}},
        "training": {"training_data": {"systems": ["data/sys0"]},
                     "validation_data": {"systems": "data/sys1"}, "numb_steps": 1},
    }  # fmt: skip
    (tmp_path / "input.json").write_text(json.dumps(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # system paths are relative to the input file, not the cwd
    assert main(["neighbor-stat", str(tmp_path / "input.json")]) == 0
    content = json.loads((elsewhere / "neighbor_stat.json").read_text())
    assert [s["path"] for s in content["systems"]] == two_systems
    assert content["rcut"] == 3.0 and content["sel_ratio"] == 1.3
    assert "sel (auto:1.3)" in capsys.readouterr().out
    # an explicit --sel-ratio wins over the input's "auto:x"
    assert main(["neighbor-stat", str(tmp_path / "input.json"), "--sel-ratio", "1.1"]) == 0
    assert json.loads((elsewhere / "neighbor_stat.json").read_text())["sel_ratio"] == 1.1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-r", "3", "-t", "O"], "missing -s/--system"),
        (["-s", "SYS", "-t", "O"], "missing -r/--rcut"),
        (["-s", "SYS", "-r", "3"], "missing -t/--type-map"),
        ([], "missing -s/--system, -r/--rcut, -t/--type-map"),
        (["-s", "SYS", "-r", "-1", "-t", "O", "H"], "rcut must be a positive"),
        (["-s", "SYS", "-r", "3", "-t", "O", "O"], "names an element twice"),
        (["INPUT", "-r", "3"], "either input.json or -s/-r/-t"),
        (["missing.json"], "missing.json: input file not found"),
    ],
)
def test_cli_errors_exit_1(argv, message, two_systems, tmp_path, capsys):
    argv = [two_systems[0] if a == "SYS" else str(tmp_path / "in.json") if a == "INPUT" else a
            for a in argv]  # fmt: skip
    assert main(["neighbor-stat", *argv, "-o", str(tmp_path / "o.json")]) == 1
    assert message in capsys.readouterr().err


def test_cli_overlap_exit_1(tmp_path, capsys):
    coords = np.array([[[0.0, 0, 0], [1.0, 0, 0]], [[0.0, 0, 0], [0.0, 0, 0]]])
    path = write_system(tmp_path / "bad", coords, [0, 1], ["O", "H"])
    assert main(["neighbor-stat", "-s", path, "-r", "3", "-t", "O", "H"]) == 1
    err = capsys.readouterr().err
    assert "bad, frame 1: atoms 0 and 1 overlap" in err and "Traceback" not in err


def test_command_does_not_import_torch(tmp_path, two_systems):
    out = tmp_path / "ns.json"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mdtrain", "neighbor-stat", "-s",
         *two_systems, "-r", "3", "-t", "O", "H", "-o", str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    imported = [line.split("|")[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert "numpy" in imported  # the import log is there
    for heavy in ("torch", "dpdata", "ase", "matplotlib", "vesin"):
        assert heavy not in imported, f"{heavy} imported"
    assert json.loads(out.read_text())["max_nbor_size"]


def test_input_form_imports_no_jsonschema_for_a_valid_input(tmp_path, two_systems):
    """A valid input passes the quick schema check (config/quick_check.py): jsonschema, a
    tenth of the command's time on thousands of small systems, is imported only to word a
    problem, and then the message is the one it always gave."""
    config = {
        "model": {"type_map": ["O", "H"], "descriptor": {"type": "se_a", "rcut": 3.0, "sel": "auto"}},
        "training": {"training_data": {"systems": two_systems}, "numb_steps": 1},
    }  # fmt: skip
    (tmp_path / "input.json").write_text(json.dumps(config))
    command = [sys.executable, "-X", "importtime", "-m", "mdtrain", "neighbor-stat",
               str(tmp_path / "input.json"), "-o", str(tmp_path / "ns.json")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    imported = [line.split("|")[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert "numpy" in imported and "mdtrain.config.loader" in imported
    for heavy in ("jsonschema", "torch"):
        assert heavy not in imported, f"{heavy} imported"
    # the process ends without tearing the interpreter down (cli._QUICK_EXIT): the table
    # (stdout to a pipe, flushed first) and the file are whole
    assert result.stdout.endswith(f"written to {tmp_path / 'ns.json'}\n")
    assert json.loads((tmp_path / "ns.json").read_text())["max_nbor_size"]
    config["model"]["descriptor"]["rcut"] = -3.0
    (tmp_path / "input.json").write_text(json.dumps(config))
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 1
    assert "input.json: model.descriptor.rcut: must be > 0, got -3.0" in result.stderr
    assert "| jsonschema" in result.stderr
