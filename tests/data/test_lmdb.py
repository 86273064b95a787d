"""LMDB data sets in DeePMD-kit 3.2's layout (written here with lmdb and msgpack,
tests/helpers/lmdb.py): frames grouped into systems by their atoms, read lazily, equal to the
same frames in deepmd/npy; ``check``, ``neighbor-stat``, ``train`` and ``test`` take an LMDB
as they take npy systems (training on it logs the same learning curve); one-line errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.data import expand_systems, open_system
from mdtrain.errors import MDTrainError
from tests.helpers.datagen import random_water_like, water_labeled, write_npy_system
from tests.helpers.lmdb import frames_of, write_lmdb
from tests.helpers.training import make_project

pytest.importorskip("lmdb")
TYPE_MAP = ["O", "H"]


def npy_frames(data: dict) -> list[dict]:
    """``water_labeled``'s frames as LMDB records, stored types in the order H, O."""
    return frames_of(
        data["coords"],
        1 - np.asarray(data["types"]),
        data.get("boxes"),
        data.get("energy"),
        data.get("force"),
        data.get("virial"),
    )


@pytest.fixture
def mixed(tmp_path):
    """One LMDB holding, interleaved, a periodic system of 8 molecules with virials, one of 4
    molecules, a non-periodic cluster without virials, and a frame of the first system's
    formula with its atoms in another order; and the same frames as npy systems."""
    big = water_labeled(nframes=3, nmol=8, seed=1)
    small = water_labeled(nframes=2, nmol=4, seed=2)
    coords, types, _ = random_water_like(2, 3, 6.0, seed=3)
    cluster = {"coords": coords, "types": types, "energy": np.array([-1.5, -2.5])}
    cluster["force"] = np.random.default_rng(3).normal(size=coords.shape)
    records = [npy_frames(d) for d in (big, small, cluster)]
    odd = dict(records[0][0])  # the first frame with its atoms reversed
    odd["atom_types"] = odd["atom_types"][::-1].copy()
    odd["coords"] = odd["coords"][::-1].copy()
    odd["forces"] = odd["forces"][::-1].copy()
    order = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (2, 1)]
    frames = [records[s][f] for s, f in order] + [odd]
    path = write_lmdb(tmp_path / "data.lmdb", frames, ["H", "O"])
    npy = {
        name: write_npy_system(tmp_path / name, **data)
        for name, data in (("big", big), ("small", small))
    }
    npy["cluster"] = write_npy_system(
        tmp_path / "cluster", coords, types, TYPE_MAP, None, cluster["energy"], cluster["force"]
    )
    return path, npy


def test_groups_read_as_the_npy_systems(mixed):
    path, npy = mixed
    systems = expand_systems(path)
    names = [p.partition("#")[2] for p in systems]
    assert names == ["H16O8", "H8O4", "H6O3", "H16O8.1"]
    for name, twin in zip(names[:3], ("big", "small", "cluster")):
        got = open_system(f"{path}#{name}", TYPE_MAP)
        want = open_system(npy[twin], TYPE_MAP)
        assert (got.natoms, got.nframes, got.periodic) == (want.natoms, want.nframes, want.periodic)
        assert got.labels == want.labels and got.elements == ["H", "O"]
        np.testing.assert_array_equal(got.atype, want.atype)
        rows = [1, 0, 1] if got.nframes > 1 else [0]
        a, b = got.frames(rows), want.frames(rows)
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
        assert got.fingerprint()["sha256"] != want.fingerprint()["sha256"]  # own types differ
    reordered = open_system(systems[3], TYPE_MAP)  # atoms sorted by type, as npy's are
    first = open_system(systems[0], TYPE_MAP).frames([0])
    np.testing.assert_array_equal(
        np.sort(reordered.frames([0])["coord"][0], axis=0), np.sort(first["coord"][0], axis=0)
    )


def test_labels_marked_missing_make_their_own_group(tmp_path):
    data = water_labeled(nframes=3, nmol=4, seed=4)
    frames = npy_frames(data)
    frames[1]["find_energy"] = np.float32(0.0)  # DeePMD-kit's flag: no energy in this frame
    path = write_lmdb(tmp_path / "d.lmdb", frames, ["H", "O"])
    systems = [open_system(p, TYPE_MAP) for p in expand_systems(path)]
    assert [(s.nframes, sorted(s.labels)) for s in systems] == [
        (2, ["energy", "force", "virial"]),
        (1, ["force", "virial"]),
    ]


def test_lmdb_errors(mixed, tmp_path):
    path, _ = mixed
    with pytest.raises(MDTrainError, match="holds 4 groups of frames; name one"):
        open_system(path, TYPE_MAP)
    with pytest.raises(MDTrainError, match=r"no group 'C2' in the LMDB \(it has H16O8, "):
        expand_systems(f"{path}#C2")
    with pytest.raises(MDTrainError, match=r"data.lmdb#H8O4: element H is not in type_map"):
        open_system(f"{path}#H8O4", ["O", "C"])

    bad = npy_frames(water_labeled(nframes=2, nmol=4, seed=5))
    bad[1]["forces"] = bad[1]["forces"][:-1]  # one atom short
    broken = write_lmdb(tmp_path / "short.lmdb", bad, ["H", "O"])
    system = open_system(broken, TYPE_MAP)
    system.frames([0])
    with pytest.raises(MDTrainError, match="short.lmdb: frame 1: forces has shape"):
        system.frames([1])

    gap = write_lmdb(tmp_path / "gap.lmdb", bad[:1], ["H", "O"], metadata={"nframes": 2})
    with pytest.raises(MDTrainError, match="gap.lmdb: frame 000000000001 is missing"):
        expand_systems(gap)
    empty = tmp_path / "plain.lmdb"
    shutil.copytree(gap, empty)
    import lmdb

    env = lmdb.open(str(empty))
    with env.begin(write=True) as txn:
        txn.delete(b"__metadata__")
    env.close()
    with pytest.raises(MDTrainError, match="plain.lmdb: no __metadata__ key"):
        expand_systems(str(empty))


def test_commands_take_an_lmdb(tmp_path, capsys):
    """A project's systems as two LMDBs (training: both systems in one), in the npy
    systems' order: check and neighbor-stat agree, training logs the same learning curve,
    and ``test`` prints the same figures."""
    npy_input = make_project(tmp_path / "npy", numb_steps=2, disp_freq=1, save_freq=2)
    data = tmp_path / "npy" / "data"
    lmdb_root = tmp_path / "lmdb"
    lmdb_root.mkdir()

    def records(name: str) -> list[dict]:
        system = open_system(str(data / name))
        store = system.store
        values = {k: store.array("set.000", k) for k in store.array_names("set.000")}
        n = system.nframes
        return frames_of(
            values["coord"].reshape(n, -1, 3),
            np.where(store.types() == 0, 1, 0),
            values["box"].reshape(n, 3, 3),
            values["energy"].reshape(n),
            values["force"].reshape(n, -1, 3),
            values["virial"].reshape(n, 9),
        )

    write_lmdb(lmdb_root / "train.lmdb", records("train_a") + records("train_b"), ["H", "O"])
    write_lmdb(lmdb_root / "valid.lmdb", records("valid"), ["H", "O"])
    config = json.loads(npy_input.read_text())
    config["training"]["training_data"]["systems"] = "train.lmdb"  # a string, as DeePMD-kit's
    config["training"]["validation_data"]["systems"] = ["valid.lmdb"]
    lmdb_input = lmdb_root / "input.json"
    lmdb_input.write_text(json.dumps(config))

    assert main(["check", str(lmdb_input)]) == 0
    assert "training: 2 systems, 16 frames" in capsys.readouterr().out
    stats = []
    for inp in (npy_input, lmdb_input):
        out = inp.parent / "neighbor_stat.json"
        assert main(["neighbor-stat", str(inp), "-o", str(out)]) == 0
        stat = json.loads(out.read_text())
        stats.append((stat["min_nbor_dist"], stat["max_nbor_size"]))
    assert stats[0] == stats[1]

    curves = []
    for inp in (npy_input, lmdb_input):
        assert main(["train", str(inp), "-o", str(inp.parent / "out")]) == 0
        curves.append((inp.parent / "out" / "lcurve.out").read_text())
    assert curves[0] == curves[1] and len(curves[0].splitlines()) == 4

    figures = []
    for system in (str(data / "valid"), str(lmdb_root / "valid.lmdb")):
        out = tmp_path / "figures.json"
        model = str(npy_input.parent / "out" / "model.ckpt.pt")
        assert main(["test", "-m", model, "-s", system, "--json", str(out)]) == 0
        figures.append(json.loads(out.read_text())["total"])
    assert figures[0] == figures[1]
