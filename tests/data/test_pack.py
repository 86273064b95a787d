"""``mdtrain convert --pack``: every array copied exactly, one group per system in order,
streamed in bounded memory, and training from the packed file equals training from the
folders."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.data import expand_systems, open_system
from mdtrain.data.pack import pack
from mdtrain.errors import MDTrainError
from tests.helpers.datagen import water_labeled, write_hdf5_system, write_npy_system
from tests.helpers.training import load_params, make_project, max_param_diff


def _sources(root: Path) -> list[str]:
    """Systems that exercise the layout: three sets, float32 arrays, an ``(n, 1)`` energy,
    an array mdtrain does not read, a system without cell or type_map.raw, an HDF5 group."""
    a = write_npy_system(root / "data" / "a", set_size=3, **water_labeled(7, 4, 6.0, seed=1))
    for set_name in ("set.000", "set.001", "set.002"):
        folder = Path(a) / set_name
        n = len(np.load(folder / "coord.npy"))
        np.save(folder / "force.npy", np.load(folder / "force.npy").astype(np.float32))
        np.save(folder / "energy.npy", np.load(folder / "energy.npy").reshape(n, 1))
        np.save(folder / "fparam.npy", np.arange(2.0 * n).reshape(n, 2))
    data = water_labeled(4, 2, 6.0, seed=2)
    data.update(boxes=None, virial=None, type_map=None)
    b = write_npy_system(root / "data" / "b_cluster", **data)
    h5 = write_hdf5_system(root / "more.h5", "c/deep", set_size=2, **water_labeled(5, 3, 6.0, 3))
    return [a, b, h5]


def _arrays(system_path: str) -> dict[str, np.ndarray]:
    """Every file of a system as stored: ``set.000/coord.npy`` → array, ``type.raw`` → ints."""
    system = open_system(system_path)
    store = system.store
    out = {"type.raw": store.types(), "nopbc": np.array(store.nopbc())}
    own_map = store.type_map()
    out["type_map.raw"] = np.array(own_map if own_map is not None else [])
    for info in system.sets:
        for name in store.array_names(info.name):
            out[f"{info.name}/{name}.npy"] = np.asarray(store.array(info.name, name))
    return out


@pytest.mark.parametrize("compression", ["none", "lzf", "gzip"])
def test_every_array_is_copied_exactly(tmp_path, compression):
    sources = _sources(tmp_path)
    out = tmp_path / "packed.h5"
    entries = [str(tmp_path / "more.h5"), str(tmp_path / "data")]
    packed = pack(entries, str(out), compression, chunk_bytes=200)
    assert [p.group for p in packed] == ["/c/deep", "/data/a", "/data/b_cluster"]
    assert expand_systems(str(out)) == [f"{out}#{p.group}" for p in packed]
    by_source = {p.source: f"{out}#{p.group}" for p in packed}
    for source in sources:
        before, after = _arrays(source), _arrays(by_source[source])
        assert before.keys() == after.keys()
        for key, value in before.items():
            assert after[key].dtype == value.dtype or key.endswith(".raw"), key
            assert after[key].shape == value.shape, key
            np.testing.assert_array_equal(after[key], value, err_msg=key)
    with h5py.File(out) as handle:
        coord = handle["data/a/set.000/coord.npy"]
        assert coord.chunks[0] < coord.shape[0]  # chunked along frames (tiny chunks here)
        assert coord.compression == (None if compression == "none" else compression)


def test_groups_keep_the_order_the_folders_give(tmp_path):
    inp = make_project(tmp_path)
    data = tmp_path / "data"
    out = tmp_path / "all.h5"
    pack([str(data)], str(out))
    folders = expand_systems(str(data))
    groups = expand_systems(str(out))
    assert [g.partition("#")[2] for g in groups] == [
        "/data/" + os.path.relpath(f, data) for f in folders
    ]
    assert inp.exists()
    with pytest.raises(MDTrainError, match="read back before"):
        pack([str(data / "valid"), str(data / "train_a")], str(tmp_path / "x.h5"))
    twin = write_npy_system(tmp_path / "other" / "train_a", **water_labeled(2, 2, 6.0, seed=6))
    with pytest.raises(MDTrainError, match="would both become group /train_a"):
        pack([str(data / "train_a"), twin], str(tmp_path / "y.h5"))
    assert not any(p.name.startswith(("x.h5", "y.h5")) for p in tmp_path.iterdir())


def test_set_size_recuts_the_frames(tmp_path):
    source = write_npy_system(tmp_path / "s", set_size=3, **water_labeled(8, 4, 6.0, seed=4))
    out = tmp_path / "recut.h5"
    pack([source], str(out), "lzf", set_size=5)
    before, after = open_system(source, ["O", "H"]), open_system(f"{out}#/s", ["O", "H"])
    assert [s.nframes for s in before.sets] == [3, 3, 2]
    assert [s.nframes for s in after.sets] == [5, 3]
    fa, fb = before.frames(np.arange(8)), after.frames(np.arange(8))
    for key in fa:
        np.testing.assert_array_equal(fa[key], fb[key])
    # an array the system reader does not know (a label it knows is refused when opening)
    np.save(Path(source) / "set.001" / "extra.npy", np.zeros((3, 1)))
    with pytest.raises(MDTrainError, match=r"extra.npy is in 1 of 3 sets"):
        pack([source], str(tmp_path / "bad.h5"), set_size=5)


def test_frames_stream_through_a_bounded_buffer(tmp_path):
    """A 25 MB system packed with a 1 MB buffer: numpy never holds much more than that
    (tracemalloc sees numpy's allocations); the whole system at once is the control."""
    rng = np.random.default_rng(0)
    nframes, natoms = 8000, 64
    root = tmp_path / "big"
    (root / "set.000").mkdir(parents=True)
    (root / "type.raw").write_text("0\n" * natoms)
    for name, width in (("coord", 3 * natoms), ("force", 3 * natoms), ("box", 9)):
        np.save(root / "set.000" / f"{name}.npy", rng.normal(size=(nframes, width)))

    def peak(buffer_bytes: int, out: str) -> int:
        tracemalloc.start()
        try:
            pack([str(root)], out, "lzf", buffer_bytes=buffer_bytes)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    streamed = peak(1 << 20, str(tmp_path / "streamed.h5"))
    whole = peak(1 << 30, str(tmp_path / "whole.h5"))
    assert streamed < 3 << 20
    assert whole > 10 << 20  # the control: a whole 12 MB array read at once is seen
    with h5py.File(tmp_path / "streamed.h5") as handle:
        force = handle["big/set.000/force.npy"][()]
    np.testing.assert_array_equal(force, np.load(root / "set.000" / "force.npy"))


def test_command_line_and_its_errors(tmp_path, capsys):
    source = write_npy_system(tmp_path / "w", **water_labeled(3, 2, 6.0, seed=5))
    assert main(["convert", "--pack", source, "-o", str(tmp_path / "w.hdf5"),
                 "--compression", "gzip"]) == 0  # fmt: skip
    assert expand_systems(str(tmp_path / "w.hdf5")) == [f"{tmp_path / 'w.hdf5'}#/w"]
    for argv, message in (
        (["--pack", source, "-o", str(tmp_path / "out")], "needs .h5 or .hdf5"),
        (["--pack", source, "-o", str(tmp_path / "t.h5"), "-t", "O", "H"], "-t: not with --pack"),
        ([source, "-o", str(tmp_path / "c.h5"), "--compression", "lzf"], "only with --pack"),
        (["--pack", source, "-o", str(tmp_path / "w.hdf5")], "already exists"),
    ):
        capsys.readouterr()
        assert main(["convert", *argv]) == 1
        assert message in capsys.readouterr().err


def test_training_from_the_packed_file_equals_training_from_the_folders(tmp_path):
    """Same seeds, float64: the packed file gives the same lcurve.out, byte for byte, and the
    same weights, bit for bit (lcurve.out shows three digits)."""
    folders = make_project(tmp_path / "folders", numb_steps=8, disp_freq=1)
    packed = make_project(tmp_path / "packed", numb_steps=8, disp_freq=1)
    data = packed.parent / "data"
    assert main(["convert", "--pack", str(data / "train_a"), str(data / "train_b"),
                 "-o", str(packed.parent / "train.h5"), "--compression", "lzf"]) == 0  # fmt: skip
    assert main(["convert", "--pack", str(data / "valid"), "-o", str(packed.parent / "v.h5")]) == 0
    config = json.loads(packed.read_text())
    config["training"]["training_data"]["systems"] = "train.h5"
    config["training"]["validation_data"]["systems"] = ["v.h5"]
    packed.write_text(json.dumps(config))
    for inp in (folders, packed):
        assert main(["train", str(inp), "-o", str(inp.parent / "out")]) == 0
    lcurve = (folders.parent / "out" / "lcurve.out").read_text()
    assert len(lcurve.splitlines()) == 10  # the header, step 0, steps 1..8
    assert (packed.parent / "out" / "lcurve.out").read_text() == lcurve
    weights = [load_params(inp.parent / "out" / "model.ckpt.pt") for inp in (folders, packed)]
    assert max_param_diff(*weights) == 0.0
