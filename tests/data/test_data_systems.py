"""mdtrain.data: deepmd/npy and deepmd/hdf5 systems, type remapping, expansion, errors."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mdtrain.data import expand_systems, open_system, validate_system
from mdtrain.data.hdf5 import close_h5
from mdtrain.errors import MDTrainError
from tests.helpers.datagen import random_water_like, write_hdf5_system, write_npy_system


def _same_frames(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# -- reading --------------------------------------------------------------------------------


def test_npy_frames_match_written_arrays(water_system, water_data):
    system = open_system(water_system, ["O", "H"])
    assert (system.natoms, system.nframes, system.periodic) == (24, 6, True)
    assert [(s.name, s.start, s.nframes) for s in system.sets] == [
        ("set.000", 0, 4),
        ("set.001", 4, 2),
    ]
    assert all(system.has(label) for label in ("energy", "force", "virial"))
    # interleaved O H H ... is sorted by type: the 8 oxygens first, in file order
    order = system.atom_order
    np.testing.assert_array_equal(order[:8], np.arange(0, 24, 3))
    np.testing.assert_array_equal(system.atype, [0] * 8 + [1] * 16)
    np.testing.assert_array_equal(water_data["types"][order], system.atype)
    index = [5, 0, 3, 4, 4]  # across both sets, unordered, repeated
    got = system.frames(index)
    np.testing.assert_array_equal(got["coord"], water_data["coords"][index][:, order])
    np.testing.assert_array_equal(got["force"], water_data["force"][index][:, order])
    np.testing.assert_array_equal(got["box"], water_data["boxes"][index])
    np.testing.assert_array_equal(got["energy"], water_data["energy"][index])
    np.testing.assert_array_equal(got["virial"], water_data["virial"][index])
    assert got["coord"].dtype == np.float64 and got["energy"].shape == (5,)


def test_npy_and_hdf5_give_identical_frames(water_system, water_h5):
    a = open_system(water_system, ["O", "H"])
    b = open_system(water_h5, ["O", "H"])
    assert (a.natoms, a.nframes, a.sets, a.labels) == (b.natoms, b.nframes, b.sets, b.labels)
    np.testing.assert_array_equal(a.atype, b.atype)
    everything = np.arange(a.nframes)
    _same_frames(a.frames(everything), b.frames(everything))
    _same_frames(a.frames([3, 1, 1]), b.frames([3, 1, 1]))
    assert a.fingerprint()["sha256"] == b.fingerprint()["sha256"]


def test_negative_and_out_of_range_indices(water_system):
    system = open_system(water_system)
    _same_frames(system.frames([-1]), system.frames([5]))
    with pytest.raises(IndexError):
        system.frames([6])


def test_nopbc_system_has_no_box(water_nopbc):
    system = open_system(water_nopbc, ["O", "H"])
    assert not system.periodic
    frames = system.frames([0, 1])
    assert "box" not in frames and "virial" not in frames
    assert system.has("force") and not system.has("virial")


def test_energy_as_column_and_float32_files(tmp_path, water_data):
    path = write_npy_system(tmp_path / "w", **water_data)
    energy = np.load(path + "/set.000/energy.npy")
    np.save(path + "/set.000/energy.npy", energy[:, None])
    coord = np.load(path + "/set.000/coord.npy")
    np.save(path + "/set.000/coord.npy", coord.astype(np.float32))
    frames = open_system(path).frames([2])
    assert frames["energy"].shape == (1,) and frames["energy"][0] == energy[2]
    assert frames["coord"].dtype == np.float64
    np.testing.assert_allclose(frames["coord"][0].reshape(-1)[:3], coord[2, [0, 1, 2]], rtol=1e-6)


def test_reading_is_lazy_and_memory_mapped(water_system, monkeypatch):
    import mdtrain.data.npy as npy
    from mdtrain.data.npy import _MAPS

    monkeypatch.setattr(npy, "DIRECT_READ_BYTES", 0)  # map even these small files
    system = open_system(water_system)
    mine = [key for key in _MAPS if key[0] == system.path]
    assert mine == []  # opening read headers only
    system.frames([1])
    assert isinstance(_MAPS[(system.path, "set.000", "coord")], np.memmap)
    assert (system.path, "set.001", "coord") not in _MAPS  # the other set was never touched


def test_open_memory_maps_are_bounded(tmp_path, water_data, monkeypatch):
    """Each memory map holds a file descriptor: thousands of systems must not keep one per
    array open (the process limit is often 1024)."""
    import mdtrain.data.npy as npy

    monkeypatch.setattr(npy, "MAX_OPEN_MAPS", 4)
    monkeypatch.setattr(npy, "DIRECT_READ_BYTES", 0)
    paths = [write_npy_system(tmp_path / f"s{k}", **water_data) for k in range(6)]
    systems = [open_system(p) for p in paths]
    descriptors = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        for system in systems:
            frames = system.frames([0, 3])
            np.testing.assert_array_equal(frames["energy"], water_data["energy"][[0, 3]])
            assert len(npy._MAPS) <= 4
    assert len(os.listdir("/proc/self/fd")) <= descriptors + 4


def test_frames_read_only_what_is_asked(water_system, water_data):
    system = open_system(water_system, ["O", "H"])
    every = system.frames([1, 4])
    assert set(every) == {"coord", "box", "energy", "force", "virial"}
    assert set(system.frames([1, 4], labels=())) == {"coord", "box"}
    energy_only = system.frames([1, 4], labels=("energy", "fparam"), positions=False)
    assert set(energy_only) == {"energy"}
    np.testing.assert_array_equal(energy_only["energy"], water_data["energy"][[1, 4]])
    np.testing.assert_array_equal(system.frames([4], labels=())["coord"], every["coord"][1:])


def test_small_files_are_read_like_mapped_ones(tmp_path, water_data, monkeypatch):
    """Files under DIRECT_READ_BYTES are read without a memory map: the same frames for any
    rows (contiguous, scattered, repeated, across sets), float32 and (n, 1) arrays included,
    and a file shorter than its header is an error naming it."""
    import mdtrain.data.npy as npy

    path = write_npy_system(tmp_path / "w", set_size=4, **water_data)
    np.save(path + "/set.000/force.npy", np.load(path + "/set.000/force.npy").astype(np.float32))
    np.save(path + "/set.001/energy.npy", np.load(path + "/set.001/energy.npy")[:, None])
    picks = [[0], [1, 2, 3], [0, 3, 5], [5, 1, 1, 4], list(range(6))]
    read = [open_system(path).frames(p) for p in picks]
    monkeypatch.setattr(npy, "DIRECT_READ_BYTES", 0)
    mapped = [open_system(path).frames(p) for p in picks]
    for a, b in zip(read, mapped, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    monkeypatch.setattr(npy, "DIRECT_READ_BYTES", 1 << 20)
    with open(path + "/set.001/coord.npy", "r+b") as handle:
        handle.truncate(handle.seek(0, 2) - 8)
    system = open_system(path)  # opens: the header is whole
    with pytest.raises(MDTrainError, match=r"set.001/coord.npy: cannot read \(shorter"):
        system.frames([5])


def test_small_arrays_are_read_with_their_headers(tmp_path, water_data, monkeypatch):
    """An array small enough to arrive whole with its header's read is kept when the system
    opens: its frames need no further read (the files may go), and equal the mapped
    reads; larger arrays are still read on request, and the amount kept is bounded."""
    import mdtrain.data.npy as npy

    path = write_npy_system(tmp_path / "w", set_size=4, **water_data)
    picks = [[0], [1, 2, 3], [5, 1, 1, 4], list(range(6))]
    monkeypatch.setattr(npy, "DIRECT_READ_BYTES", 0)  # nothing kept: every array mapped
    mapped = [open_system(path).frames(p) for p in picks]
    monkeypatch.setattr(npy, "DIRECT_READ_BYTES", 1 << 20)
    monkeypatch.setattr(npy, "KEEP_BYTES", 24 * 3 * 8 * 2)  # set.001's coord and force only
    system = open_system(path)
    before = npy._kept_total
    kept = sorted(system.store._kept)
    assert kept == [("set.000", n) for n in ("box", "energy", "virial")] + [
        ("set.001", n) for n in ("box", "coord", "energy", "force", "virial")
    ]
    for name in ("coord", "force"):  # set.001's, kept, can go; set.000's are read again
        os.remove(os.path.join(path, "set.001", name + ".npy"))
    for p, expected in zip(picks, mapped, strict=True):
        _same_frames(system.frames(p), expected)
    assert system.frames([4])["coord"].flags.writeable  # a copy, not the kept bytes
    del system
    assert npy._kept_total < before  # released with the store
    monkeypatch.setattr(npy, "MAX_KEPT_BYTES", npy._kept_total)  # the budget is spent
    other = write_npy_system(tmp_path / "v", set_size=4, **water_data)
    assert open_system(other).store._kept == {}


def test_arrays_read_again_are_kept(tmp_path, water_data, monkeypatch):
    """A small file read a second time (a training step's frames) is read whole and kept:
    later frames need no read (the files may go) and equal the mapped reads; the memory
    kept is counted and bounded."""
    import mdtrain.data.npy as npy

    path = write_npy_system(tmp_path / "w", set_size=4, **water_data)
    picks = [[1], [2, 3], [5, 1, 1, 4], list(range(6))]
    monkeypatch.setattr(npy, "DIRECT_READ_BYTES", 0)  # every array mapped
    mapped = [open_system(path).frames(p) for p in picks]
    monkeypatch.setattr(npy, "DIRECT_READ_BYTES", 1 << 20)
    monkeypatch.setattr(npy, "KEEP_BYTES", 0)  # nothing kept with the headers
    system = open_system(path)
    assert system.store._kept == {}
    _same_frames(system.frames(picks[0]), mapped[0])  # read once: not kept
    assert system.store._kept == {}
    before = npy._kept_total
    _same_frames(system.frames(picks[1]), mapped[1])  # again: set.000's arrays kept
    assert ("set.000", "coord") in system.store._kept and ("set.000", "force") in system.store._kept
    assert npy._kept_total > before
    for name in ("coord", "force", "energy", "box", "virial"):
        os.remove(os.path.join(path, "set.000", name + ".npy"))
    every = mapped[-1]  # frames 0 to 5
    _same_frames(system.frames([0, 2]), {k: v[[0, 2]] for k, v in every.items()})
    assert system.frames([3])["coord"].flags.writeable  # a copy, not the kept bytes
    monkeypatch.setattr(npy, "MAX_KEPT_BYTES", npy._kept_total)  # the budget is spent
    other = open_system(write_npy_system(tmp_path / "v", set_size=4, **water_data))
    for p in picks:
        other.frames(p)
    assert other.store._kept == {}


def test_frame_count_comes_from_the_header(tmp_path, water_data):
    path = write_npy_system(tmp_path / "w", **water_data)
    file = path + "/set.000/force.npy"
    size = os.path.getsize(file)
    with open(file, "r+b") as handle:
        handle.truncate(size - 100)  # header intact, data cut short
    system = open_system(path)  # opens: counts from the header
    assert system.nframes == 6
    with pytest.raises(MDTrainError, match="force.npy"):
        system.frames([0])


def test_positions_only_defers_the_label_files(tmp_path, water_data, water_system, water_h5):
    from mdtrain.data import open_all

    for path in (water_system, water_h5):
        full, quick = (
            open_all([path], ["H", "O"]),
            open_all([path], ["H", "O"], positions_only=True),
        )
        assert quick[0]._labels is None  # not read yet
        assert (quick[0].nframes, quick[0].sets) == (full[0].nframes, full[0].sets)
        assert np.array_equal(quick[0].atype, full[0].atype)
        rows = np.arange(full[0].nframes)
        _same_frames(quick[0].frames(rows, labels=()), full[0].frames(rows, labels=()))
        assert quick[0]._labels is None  # positions never ask for them
        assert quick[0].fingerprint() == full[0].fingerprint()
        assert quick[0].labels == full[0].labels == {"energy", "force", "virial"}
        _same_frames(quick[0].frames(rows), full[0].frames(rows))
    # a label file that does not fit: reported when the labels are first asked, as at opening
    bad = write_npy_system(tmp_path / "bad", **water_data)
    np.save(bad + "/set.000/virial.npy", np.zeros((5, 9)))
    with pytest.raises(MDTrainError, match="virial.npy: 5 frames but coord.npy has 6") as full:
        open_system(bad)
    quick = open_all([bad], positions_only=True)[0]
    assert quick.frames([0], labels=())["coord"].shape == (1, 24, 3)
    with pytest.raises(MDTrainError) as late:
        quick.has("energy")
    assert str(late.value) == str(full.value)
    np.save(bad + "/set.000/box.npy", np.zeros((5, 9)))  # the cells are checked at opening
    with pytest.raises(MDTrainError, match="box.npy: 5 frames but coord.npy has 6"):
        open_all([bad], positions_only=True)


def test_system_pickles_without_its_data(water_system, water_h5):
    for path in (water_system, water_h5):
        system = open_system(path, ["O", "H"])
        system.frames([0, 5])  # populate memory maps / handles
        blob = pickle.dumps(system)
        assert len(blob) < 4000
        _same_frames(pickle.loads(blob).frames([2, 5]), system.frames([2, 5]))


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_hdf5_reads_after_fork(water_h5):
    system = open_system(water_h5, ["O", "H"])
    parent = system.frames([1, 4])["coord"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: read through its own handle, report by exit code
        ok = False
        try:
            ok = np.array_equal(system.frames([1, 4])["coord"], parent)
        finally:
            os._exit(0 if ok else 1)
    os.close(write)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(system.frames([1, 4])["coord"], parent)  # parent still reads


def test_hdf5_handle_reopens_after_rewrite(tmp_path, water_data):
    h5 = tmp_path / "d.h5"
    first = write_hdf5_system(h5, "a", **water_data)
    open_system(first).frames([0])
    second = write_hdf5_system(h5, "b", **water_data)  # append while mdtrain holds it open
    _same_frames(open_system(second).frames([0, 1]), open_system(first).frames([0, 1]))


def test_import_does_not_load_torch():
    code = (
        "import sys, mdtrain.data, mdtrain.data.convert\n"
        "assert 'torch' not in sys.modules\n"
        "assert 'h5py' not in sys.modules and 'dpdata' not in sys.modules  # on first use"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- type remapping -------------------------------------------------------------------------


def test_type_map_raw_in_another_order(tmp_path, water_data):
    data = dict(water_data)
    oh = open_system(write_npy_system(tmp_path / "oh", **data), ["O", "H"])
    data["types"] = 1 - water_data["types"]  # H = 0, O = 1
    data["type_map"] = ["H", "O"]
    ho = open_system(write_npy_system(tmp_path / "ho", **data), ["O", "H"])
    assert ho.elements == ["H", "O"]
    np.testing.assert_array_equal(ho.atype, oh.atype)
    np.testing.assert_array_equal(ho.atom_order, oh.atom_order)
    _same_frames(ho.frames(range(6)), oh.frames(range(6)))
    # without a model type_map the system's own types are used (H first)
    own = open_system(tmp_path / "ho")
    np.testing.assert_array_equal(own.atype, [0] * 16 + [1] * 8)


def test_subset_and_unused_elements(tmp_path):
    coords = np.random.default_rng(0).uniform(0, 5, size=(2, 3, 3))
    box = np.repeat(np.eye(3)[None] * 5, 2, 0)
    path = write_npy_system(tmp_path / "h", coords, [0, 0, 0], ["H", "Cl"], box)
    system = open_system(path, ["C", "O", "H"])  # Cl is listed but unused: fine
    np.testing.assert_array_equal(system.atype, [2, 2, 2])
    path = write_npy_system(tmp_path / "hcl", coords, [0, 1, 0], ["H", "Cl"], box)
    with pytest.raises(MDTrainError, match=r"hcl.*element Cl is not in type_map"):
        open_system(path, ["C", "O", "H"])


def test_types_without_type_map_raw(tmp_path):
    coords = np.zeros((1, 3, 3)) + np.arange(3)[:, None]
    path = write_npy_system(tmp_path / "s", coords, [2, 0, 1], None, None)
    system = open_system(path, ["A", "B", "C"])
    np.testing.assert_array_equal(system.atype, [0, 1, 2])
    np.testing.assert_array_equal(system.atom_order, [1, 2, 0])
    assert system.elements == ["A", "B", "C"]
    with pytest.raises(MDTrainError, match="type 2 but type_map has 2 elements"):
        open_system(path, ["A", "B"])


# -- expansion ------------------------------------------------------------------------------


def test_directory_expansion(tmp_path, water_data):
    for name in ("b/sys1", "a", "b/deep/sys2"):
        write_npy_system(tmp_path / "root" / name, **water_data)
    (tmp_path / "root" / "empty").mkdir()
    found = expand_systems("root", base_dir=str(tmp_path))
    assert found == [str(tmp_path / "root" / n) for n in ("a", "b/deep/sys2", "b/sys1")]
    # a list keeps entry order, drops duplicates; a system directory is itself
    again = expand_systems([str(tmp_path / "root/b/sys1"), "root/a", "root"], str(tmp_path))
    assert again[:2] == [str(tmp_path / "root/b/sys1"), str(tmp_path / "root/a")]
    assert len(again) == 3


def _walk_reference(top: str) -> list[str]:
    """The systems below ``top`` as os.walk finds them, a realpath per folder."""
    found, visited = [], set()
    for root, dirs, files in os.walk(top, followlinks=True):
        if os.path.realpath(root) in visited:
            dirs[:] = []
            continue
        visited.add(os.path.realpath(root))
        if "type.raw" in files:
            found.append(os.path.normpath(root))
        dirs[:] = [d for d in dirs if not d.startswith("set.")]
    return sorted(found)


def test_directory_expansion_follows_links_once(tmp_path):
    root = tmp_path / "root"
    for name in ("a/s1", "a/s1/inner", "b/s2", "c"):  # a system may hold another
        (root / name / "set.000").mkdir(parents=True)
        (root / name / "type.raw").write_text("0\n")
    (root / "b" / "s2" / "set.000" / "type.raw").write_text("0\n")  # inside a set: not one
    (root / "a" / "loop").symlink_to(root)  # a cycle
    (root / "z_again").symlink_to(root / "b")  # the same systems under a second name
    (root / "a" / "y_link").symlink_to(root / "c")
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "outside" / "s3").mkdir(parents=True)
    (tmp_path / "outside" / "s3" / "type.raw").write_text("0\n")
    (root / "out").symlink_to(tmp_path / "outside")
    found = expand_systems(str(root))
    assert found == _walk_reference(str(root))
    assert len(found) == 5 and str(root / "out" / "s3") in found
    linked = tmp_path / "linked_root"
    linked.symlink_to(root)
    assert expand_systems(str(linked)) == _walk_reference(str(linked))


def test_listings_of_the_walk_open_the_same_systems(tmp_path, water_data, monkeypatch):
    """The folder entries `expand_systems` hands over (``listings``) open each system as
    listing it afresh does, and the folders are not listed again."""
    from mdtrain.data import open_all

    for name in ("a", "b/sys1", "b/deep/sys2"):
        write_npy_system(tmp_path / "root" / name, **water_data)
    (tmp_path / "root" / "a" / "nopbc").write_text("")
    listings: dict = {}
    found = expand_systems("root", str(tmp_path), listings)
    assert found == expand_systems("root", str(tmp_path)) and sorted(listings) == sorted(found)
    assert listings[found[0]].sets == ["set.000"] and listings[found[0]].files["nopbc"]
    fresh = open_all(found, ["O", "H"], positions_only=True)
    listed = []
    monkeypatch.setattr(os, "scandir", lambda path: listed.append(path) or os.listdir(path))
    handed = open_all(found, ["O", "H"], positions_only=True, listings=listings)
    assert listed == [] and listings == {}  # each listing used once, nothing listed again
    for a, b in zip(fresh, handed, strict=True):
        assert (a.path, a.natoms, a.nframes, a.periodic, a.sets) == (
            b.path, b.natoms, b.nframes, b.periodic, b.sets)  # fmt: skip
        _same_frames(a.frames(range(a.nframes)), b.frames(range(b.nframes)))


def test_hdf5_expansion(tmp_path, water_data):
    h5 = tmp_path / "data.h5"
    for group in ("train/w2", "train/w1", "valid/w3"):
        write_hdf5_system(h5, group, **water_data)
    assert expand_systems(str(h5)) == [f"{h5}#/{g}" for g in ("train/w1", "train/w2", "valid/w3")]
    assert expand_systems("data.h5#/train", str(tmp_path)) == [
        f"{h5}#/train/w1",
        f"{h5}#/train/w2",
    ]
    assert expand_systems(f"{h5}#valid/w3") == [f"{h5}#/valid/w3"]
    with pytest.raises(MDTrainError, match="no such group"):
        expand_systems(f"{h5}#/nothing")
    with pytest.raises(MDTrainError, match="holds 3 systems"):
        open_system(str(h5))


def test_hdf5_root_system(tmp_path, water_data):
    h5 = tmp_path / "root.h5"
    write_hdf5_system(h5, "/", **water_data)
    assert expand_systems(str(h5)) == [f"{h5}#/"]
    assert open_system(str(h5)).nframes == 6


def test_expansion_errors(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(MDTrainError, match="no directory holding type.raw"):
        expand_systems(str(tmp_path / "nothing"))
    with pytest.raises(MDTrainError, match="does not exist"):
        expand_systems("missing", str(tmp_path))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(MDTrainError, match="neither a directory nor an HDF5 file"):
        expand_systems(str(tmp_path / "notes.txt"))


# -- layout errors --------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    """A writer of a 2-set, 3-atom system with labels; returns its path."""

    def make(name="s", **overrides):
        rng = np.random.default_rng(1)
        kwargs = dict(
            coords=rng.uniform(0, 4, size=(4, 3, 3)),
            types=[0, 1, 1],
            type_map=["O", "H"],
            boxes=np.repeat(np.eye(3)[None] * 4, 4, 0),
            energy=rng.normal(size=4),
            force=rng.normal(size=(4, 3, 3)),
            set_size=2,
        )
        kwargs.update(overrides)
        return write_npy_system(tmp_path / name, **kwargs)

    return make


def test_error_missing_type_raw(small):
    path = small()
    os.remove(path + "/type.raw")
    with pytest.raises(MDTrainError, match=r"system .*/s: type.raw is missing"):
        open_system(path)


def test_error_missing_coord(small):
    path = small()
    os.remove(path + "/set.001/coord.npy")
    with pytest.raises(MDTrainError, match=r"s/set.001/coord.npy: missing"):
        open_system(path)


def test_error_shape_mismatch(small):
    path = small()
    np.save(path + "/set.001/coord.npy", np.zeros((2, 12)))
    with pytest.raises(
        MDTrainError, match=r"set.001/coord.npy: shape \[2, 12\].*\[nframes, 9\] \(3 atoms"
    ):
        open_system(path)
    path = small("f")
    np.save(path + "/set.000/force.npy", np.zeros((2, 6)))
    with pytest.raises(MDTrainError, match=r"set.000/force.npy: shape"):
        open_system(path)


def test_error_frame_count_mismatch(small):
    path = small()
    np.save(path + "/set.000/energy.npy", np.zeros(3))
    with pytest.raises(MDTrainError, match=r"set.000/energy.npy: 3 frames but coord.npy has 2"):
        open_system(path)


def test_error_box_missing_for_periodic(small):
    path = small()
    os.remove(path + "/set.000/box.npy")
    with pytest.raises(MDTrainError, match=r"set.000/box.npy: missing in a periodic system"):
        open_system(path)
    open(path + "/nopbc", "w").close()  # declared non-periodic: fine
    assert not open_system(path).periodic


def test_error_inconsistent_labels(small):
    path = small()
    os.remove(path + "/set.001/force.npy")
    with pytest.raises(MDTrainError, match=r"s: set.000 has force.npy but set.001 does not"):
        open_system(path)


def test_error_empty_system(small):
    path = small(set_size=None, energy=None, force=None)
    np.save(path + "/set.000/coord.npy", np.zeros((0, 9)))
    np.save(path + "/set.000/box.npy", np.zeros((0, 9)))
    with pytest.raises(MDTrainError, match="has no frames"):
        open_system(path)
    path = small("nosets")
    for set_name in ("set.000", "set.001"):
        for f in os.listdir(f"{path}/{set_name}"):
            os.remove(f"{path}/{set_name}/{f}")
        os.rmdir(f"{path}/{set_name}")
    with pytest.raises(MDTrainError, match="no set.. directories"):
        open_system(path)


def test_error_bad_type_files(small):
    path = small()
    with open(path + "/type.raw", "w") as handle:
        handle.write("0 1 x\n")
    with pytest.raises(MDTrainError, match="type.raw: expected whitespace-separated integers"):
        open_system(path)
    path = small("short_map", type_map=["O"])
    with pytest.raises(MDTrainError, match="type_map.raw names only 1 elements"):
        open_system(path)


def test_error_corrupt_hdf5(tmp_path, water_data):
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not an hdf5 file at all" * 100)
    with pytest.raises(MDTrainError, match=r"garbage.h5 is not an HDF5 file"):
        open_system(f"{garbage}#/water")
    with pytest.raises(MDTrainError, match="garbage.h5 is neither"):
        expand_systems(str(garbage))
    h5 = tmp_path / "cut.h5"
    write_hdf5_system(h5, "water", **water_data)
    size = os.path.getsize(h5)
    with open(h5, "r+b") as handle:
        handle.truncate(size // 2)
    close_h5()
    with pytest.raises(MDTrainError, match=r"cut.h5"):
        open_system(f"{h5}#/water").frames(np.arange(6))


def test_error_missing_paths(tmp_path, water_h5):
    with pytest.raises(MDTrainError, match="does not exist"):
        open_system(str(tmp_path / "nowhere"))
    with pytest.raises(MDTrainError, match="HDF5 file .* does not exist"):
        open_system(str(tmp_path / "none.h5") + "#/a")
    with pytest.raises(MDTrainError, match="no such group"):
        open_system(water_h5 + "x")
    with h5py.File(water_h5.split("#")[0], "r") as handle:
        assert "water" in handle


# -- fingerprint and content checks ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["npy", "hdf5"])
def test_fingerprint_tracks_coordinates(kind, tmp_path, water_data):
    def write(name, data):
        if kind == "npy":
            return write_npy_system(tmp_path / name, set_size=4, **data)
        return write_hdf5_system(tmp_path / f"{name}.h5", "w", set_size=4, **data)

    base = open_system(write("a", water_data)).fingerprint()
    assert base == open_system(write("a2", water_data)).fingerprint() | {"path": base["path"]}
    assert set(base) == {"path", "nframes", "natoms", "sha256"}
    assert (base["nframes"], base["natoms"]) == (6, 24)
    changed = dict(water_data, coords=water_data["coords"].copy())
    changed["coords"][5, 7, 1] += 1e-9
    assert open_system(write("b", changed)).fingerprint()["sha256"] != base["sha256"]
    boxed = dict(water_data, boxes=water_data["boxes"] * 1.0001)
    assert open_system(write("c", boxed)).fingerprint()["sha256"] != base["sha256"]
    relabeled = dict(water_data, energy=water_data["energy"] + 1)  # labels are not hashed
    assert open_system(write("d", relabeled)).fingerprint()["sha256"] == base["sha256"]


def test_validate_system_reports_bad_frames(tmp_path, water_data):
    assert validate_system(open_system(write_npy_system(tmp_path / "ok", **water_data))) == []
    data = dict(water_data, coords=water_data["coords"].copy(), force=water_data["force"].copy())
    data["coords"][4, 0, 0] = np.nan
    data["force"][1, 3, 2] = np.inf
    data["boxes"] = water_data["boxes"].copy()
    data["boxes"][2, 2] = 0.0
    system = open_system(write_npy_system(tmp_path / "bad", set_size=4, **data))
    problems = validate_system(system, chunk=3)
    assert any("coord holds NaN or inf in frame 4" in p for p in problems)
    assert any("force holds NaN or inf in frame 1" in p for p in problems)
    assert any("box is singular" in p and "frame 2" in p for p in problems)
    assert len(problems) == 3 and all(system.path in p for p in problems)


def test_clean_systems_agrees_with_validate_system(tmp_path, water_data, monkeypatch):
    from mdtrain.data import validate
    from mdtrain.data.validate import clean_systems

    def bad(key, index, value):
        data = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in water_data.items()}
        data[key][index] = value
        return data

    variants = [
        water_data,
        bad("coords", (4, 0, 0), np.nan),
        bad("force", (1, 3, 2), np.inf),
        bad("energy", (5,), np.nan),
        bad("boxes", (2, 2), 0.0),  # a singular cell
        water_data,
    ]
    systems = [
        open_system(write_npy_system(tmp_path / f"s{k}", set_size=4, **data))
        for k, data in enumerate(variants)
    ]
    truncated = write_npy_system(tmp_path / "short", **water_data)  # a read that fails
    with open(truncated + "/set.000/virial.npy", "r+b") as handle:
        handle.truncate(os.path.getsize(truncated + "/set.000/virial.npy") - 8)
    systems.append(open_system(truncated))
    expected = [True, False, False, False, False, True, False]
    assert clean_systems(systems) == expected
    assert [not validate_system(s) for s in systems[:-1]] == expected[:-1]
    monkeypatch.setattr(validate, "_FAST_VALUES", 10)  # large systems: checked on their own
    assert clean_systems(systems[:1]) == [False]


def test_random_water_is_sane():
    coords, types, boxes = random_water_like(3, 27, 9.3, seed=4, triclinic=True)
    from ase import Atoms
    from ase.neighborlist import neighbor_list

    for f in range(3):
        atoms = Atoms(
            numbers=np.where(types == 0, 8, 1), positions=coords[f], cell=boxes[f], pbc=True
        )
        i, j, d = neighbor_list("ijd", atoms, 1.2)
        # only intramolecular O-H bonds are shorter than 1.2 Å
        assert len(d) == 2 * 2 * 27
        assert np.all(np.abs(d - 0.957) < 0.04)
        assert np.all(i // 3 == j // 3)


@pytest.mark.parametrize("form", ["{}", "{}.0", " {}.000e0 "])
def test_type_raw_longer_than_the_first_read_and_written_with_a_point(tmp_path, form):
    """type.raw longer than the first read (HEAD_BYTES) is read whole; types written as
    numbers with a point read as the integers they are."""
    from mdtrain.data.npy import HEAD_BYTES

    natoms = HEAD_BYTES // 2 + 7  # "0\n" per atom at least: past the first read
    types = np.arange(natoms) % 2
    coords = np.random.default_rng(0).uniform(0, 30, (1, natoms, 3))
    path = write_npy_system(tmp_path / "s", coords, types, ["A", "B"], np.eye(3)[None] * 30)
    (tmp_path / "s" / "type.raw").write_text("\n".join(form.format(t) for t in types) + "\n")
    assert os.path.getsize(tmp_path / "s" / "type.raw") > HEAD_BYTES
    system = open_system(path)
    assert system.natoms == natoms
    assert np.array_equal(np.sort(system.atype), np.sort(types))
    assert system.elements == ["A", "B"]


def test_systems_sharing_a_type_file_keep_their_own_types(tmp_path, water_data):
    """Type files are worked out once per distinct ``type.raw`` text (many small systems):
    another ``type_map.raw`` or none, another model type_map, or a bad file still count."""
    from mdtrain.data import open_all

    plain = write_npy_system(tmp_path / "a", **water_data)
    swapped = write_npy_system(tmp_path / "b", **{**water_data, "type_map": ["H", "O"]})
    bare = write_npy_system(tmp_path / "c", **{**water_data, "type_map": None})
    a, b, c = open_all([plain, swapped, bare], ["O", "H"], positions_only=True)
    types = water_data["types"]
    assert a.elements == ["O", "H"] and b.elements == ["H", "O"] and c.elements == ["O", "H"]
    assert np.array_equal(np.sort(a.atype), np.sort(types))
    assert np.array_equal(np.sort(b.atype), np.sort(1 - types))
    assert np.array_equal(c.atype, a.atype) and a.fingerprint() != b.fingerprint()
    a.atype[0] = 1  # a system's arrays are its own
    assert open_all([plain], ["O", "H"])[0].atype[0] == 0 and b.atype[0] == 0
    assert open_all([plain], ["H", "O"])[0].elements == ["O", "H"]
    for path in (plain, plain):  # a bad file is reported each time, not remembered
        with open(os.path.join(path, "type_map.raw"), "w") as handle:
            handle.write("O\n")
        with pytest.raises(MDTrainError, match="names only 1 elements"):
            open_all([path], ["O", "H"], positions_only=True)


def test_positions_only_reports_bad_cells_and_coordinates_alike(tmp_path, water_data):
    from mdtrain.data import open_all

    for name, shape in (("coord", (6, 70)), ("box", (6, 3, 2)), ("box", (5, 9))):
        path = write_npy_system(tmp_path / f"{name}{len(shape)}", **water_data)
        np.save(f"{path}/set.000/{name}.npy", np.zeros(shape))
        with pytest.raises(MDTrainError) as full:
            open_system(path, ["O", "H"])
        with pytest.raises(MDTrainError) as quick:
            open_all([path], ["O", "H"], positions_only=True)
        assert str(quick.value) == str(full.value) and f"{name}.npy" in str(full.value)
    path = write_npy_system(tmp_path / "text", **water_data)
    np.save(f"{path}/set.000/box.npy", np.array([["x"] * 9] * 6))
    with pytest.raises(MDTrainError, match="box.npy: expected numbers"):
        open_all([path], ["O", "H"], positions_only=True)
    np.save(f"{path}/set.000/box.npy", water_data["boxes"].reshape(6, 3, 3))  # as dpdata may
    assert open_all([path], ["O", "H"], positions_only=True)[0].nframes == 6
