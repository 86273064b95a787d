"""Mixed-type systems (``set.*/real_atom_types.npy``): one System per composition, virtual
atoms removed, frames read lazily; their errors; packing and converting them."""

from __future__ import annotations

import os

import dpdata
import h5py
import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.data import expand_systems, open_all, open_system, open_systems, validate_system
from mdtrain.data.hdf5 import close_h5
from mdtrain.data.labels import output_labels
from mdtrain.errors import MDTrainError
from tests.helpers.datagen import mixed_labeled, write_hdf5_system, write_npy_system

MODEL_MAP = ["H", "X", "O"]  # another order than the data's type_map.raw (O H X)


@pytest.fixture
def mixed(tmp_path):
    """A mixed-type system of 9 frames in sets of 4, with virtual atoms and the atoms of each
    frame in an order of its own; and its arrays."""
    data = mixed_labeled(nframes=9, virtual=True, shuffle=True)
    return write_npy_system(tmp_path / "mixed", set_size=4, **data), data


def _expected(data: dict, model_map: list[str]) -> dict[tuple, dict]:
    """Brute force: per composition (atoms per type), its frames and each frame's real atoms
    sorted by model type (stable)."""
    own = data["type_map"]
    groups: dict[tuple, dict] = {}
    for f, row in enumerate(data["real_types"]):
        real = np.flatnonzero(row >= 0)
        model = np.array([model_map.index(own[t]) for t in row[real]])
        key = tuple(np.bincount(model, minlength=len(model_map)).tolist())
        group = groups.setdefault(key, {"frames": [], "atoms": []})
        group["frames"].append(f)
        group["atoms"].append(real[np.argsort(model, kind="stable")])
        group["atype"] = np.sort(model, kind="stable")
    return groups


def test_one_system_per_composition_matches_brute_force(mixed):
    path, data = mixed
    systems = open_systems(path, MODEL_MAP)
    expected = _expected(data, MODEL_MAP)
    assert len(systems) == len(expected) == 3
    firsts = [min(g["frames"]) for g in expected.values()]
    assert firsts == sorted(firsts)  # compositions in the order of their first frames
    for system, group in zip(systems, expected.values(), strict=True):
        frames = group["frames"]
        assert system.source == path and system.path.startswith(f"{path}[")
        assert system.nframes == len(frames) and system.natoms == len(group["atype"])
        np.testing.assert_array_equal(system.atype, group["atype"])
        got = system.frames(np.arange(system.nframes)[::-1])  # any order, across sets
        back = frames[::-1]
        atoms = np.array(group["atoms"][::-1])[:, :, None]
        coord, force = data["coords"][back], data["force"][back]
        np.testing.assert_array_equal(got["coord"], np.take_along_axis(coord, atoms, 1))
        np.testing.assert_array_equal(got["force"], np.take_along_axis(force, atoms, 1))
        np.testing.assert_array_equal(got["energy"], data["energy"][back])
        np.testing.assert_array_equal(got["box"], data["boxes"][back])
        np.testing.assert_array_equal(got["virial"], data["virial"][back])
        assert validate_system(system) == []
    # virtual atoms (-1) are gone: the first composition lost a molecule
    assert [s.natoms for s in systems] == [9, 12, 12]


def test_dpdata_reads_the_same_frames(mixed):
    """dpdata's own deepmd/npy/mixed reader, an independent reference: same compositions,
    same coordinates per atom (both sort the real atoms by type)."""
    path, data = mixed
    ours = {s.path.rpartition("[")[2].rstrip("]"): s for s in open_systems(path, data["type_map"])}
    theirs = dpdata.MultiSystems().load_systems_from_file(
        os.path.dirname(path), fmt="deepmd/npy/mixed", type_map=data["type_map"]
    )
    assert len(theirs) == len(ours)
    for system in theirs:
        names, counts = system["atom_names"], system["atom_numbs"]
        formula = "".join(f"{n}{c}" for n, c in zip(names, counts, strict=True) if c)
        mine = ours[formula]
        got = mine.frames(np.arange(mine.nframes))
        order = np.argsort(system["atom_types"], kind="stable")
        np.testing.assert_allclose(got["coord"], system["coords"][:, order], rtol=0, atol=1e-12)
        np.testing.assert_allclose(got["energy"], system["energies"], rtol=1e-12)
        np.testing.assert_allclose(got["force"], system["forces"][:, order], atol=1e-12)


def test_hdf5_form_reads_like_npy(tmp_path, mixed):
    path, data = mixed
    h5 = write_hdf5_system(tmp_path / "m.h5", "mixed", set_size=4, **data)
    npy, hdf = open_all([path], MODEL_MAP), open_all(expand_systems([str(tmp_path / "m.h5")]))
    assert [s.path.partition("[")[2] for s in hdf] == [s.path.partition("[")[2] for s in npy]
    assert all(s.source == h5 for s in hdf)
    for a, b in zip(npy, open_all([h5], MODEL_MAP), strict=True):
        fa, fb = a.frames(range(a.nframes)), b.frames(range(b.nframes))
        assert fa.keys() == fb.keys()
        for key in fa:
            np.testing.assert_array_equal(fa[key], fb[key])
        assert a.fingerprint()["sha256"] == b.fingerprint()["sha256"]
    close_h5()


def test_systems_pickle_and_plain_systems_are_unchanged(mixed, tmp_path):
    import pickle

    path, _ = mixed
    system = open_systems(path, MODEL_MAP)[1]
    copy = pickle.loads(pickle.dumps(system))
    np.testing.assert_array_equal(copy.frames([0, 2])["coord"], system.frames([0, 2])["coord"])
    plain = write_npy_system(tmp_path / "plain", **mixed_labeled(nframes=2) | {"real_types": None})
    (one,) = open_systems(plain)
    assert one.source == one.path == plain
    with pytest.raises(MDTrainError, match="mixed-type.*open it with mdtrain.data.open_systems"):
        open_system(path)


def _rewrite(path: str, set_name: str, values: np.ndarray) -> None:
    np.save(os.path.join(path, set_name, "real_atom_types.npy"), values)


def test_errors_name_the_file_and_frame(mixed):
    path, data = mixed
    real = data["real_types"]
    where = os.path.join(path, "set.001", "real_atom_types.npy")
    bad = real[4:8].copy()
    bad[2, 5] = 3  # type_map.raw names 3 types
    _rewrite(path, "set.001", bad)
    with pytest.raises(MDTrainError) as info:
        open_systems(path, MODEL_MAP)
    assert str(info.value) == (
        f"{where}: frame 2 has type 3, but type_map.raw names 3 types (0..2; -1 marks a "
        "virtual atom)"
    )
    bad[2, 5] = -1
    bad[1] = -1
    _rewrite(path, "set.001", bad)
    with pytest.raises(MDTrainError, match=r"set.001/real_atom_types.npy: frame 1 has no real"):
        open_systems(path, MODEL_MAP)
    _rewrite(path, "set.001", real[4:7])
    with pytest.raises(MDTrainError, match="3 frames but coord.npy has 4"):
        open_systems(path, MODEL_MAP)
    _rewrite(path, "set.001", real[4:8, :-1])
    with pytest.raises(MDTrainError, match=r"shape \[4, 11\] does not match \[nframes, 12\]"):
        open_systems(path, MODEL_MAP)
    _rewrite(path, "set.001", real[4:8] + 0.5)
    with pytest.raises(MDTrainError, match="frame 0 holds a type that is not an integer"):
        open_systems(path, MODEL_MAP)
    os.remove(where)
    with pytest.raises(MDTrainError, match="set.001/real_atom_types.npy: missing, but set.000"):
        open_systems(path, MODEL_MAP)
    _rewrite(path, "set.001", real[4:8])
    with pytest.raises(MDTrainError, match="element X is not in type_map"):
        open_systems(path, ["O", "H"])
    os.remove(os.path.join(path, "type_map.raw"))
    with pytest.raises(MDTrainError, match="needs type_map.raw"):
        open_systems(path)
    assert [s.elements for s in open_systems(path, ["O", "H", "X"])][1] == ["O", "H", "X"]


def test_bad_frames_are_named_by_their_frame_in_the_files(mixed):
    path, data = mixed
    coord = np.load(os.path.join(path, "set.001", "coord.npy"))
    coord[3, 0] = np.nan  # frame 7 of the files
    np.save(os.path.join(path, "set.001", "coord.npy"), coord)
    problems = [p for s in open_systems(path, MODEL_MAP) for p in validate_system(s)]
    composition = next(s for s in open_systems(path, MODEL_MAP) if 7 in _frames_of(s, data))
    assert problems == [f"system {composition.path}: coord holds NaN or inf in frame 7"]


def _frames_of(system, data) -> list[int]:
    key = system.path.rpartition("[")[2].rstrip("]")
    rows = data["real_types"]
    names = data["type_map"]
    out = []
    for f, row in enumerate(rows):
        counts = np.bincount(row[row >= 0], minlength=len(names))
        if "".join(f"{names[t]}{n}" for t, n in enumerate(counts) if n) == key:
            out.append(f)
    return out


def test_pack_copies_a_mixed_system_whole(mixed, tmp_path):
    path, _ = mixed
    out = tmp_path / "packed.h5"
    assert main(["convert", "--pack", path, "-o", str(out)]) == 0
    with h5py.File(out) as handle:
        assert handle["mixed/set.001/real_atom_types.npy"].shape == (4, 12)
    packed = open_all(expand_systems([str(out)]), MODEL_MAP)
    for a, b in zip(open_systems(path, MODEL_MAP), packed, strict=True):
        np.testing.assert_array_equal(a.frames([0])["coord"], b.frames([0])["coord"])
    close_h5()


@pytest.mark.parametrize("to", ["deepmd/npy/mixed", "deepmd/hdf5/mixed"])
def test_convert_to_mixed_and_back(mixed, tmp_path, to):
    """Mixed → plain systems (one per composition) → mixed (one per atom count, padded to 8)
    → the same frames per composition; dpdata reads the mixed output."""
    path, _ = mixed
    plain, back = tmp_path / "plain", str(tmp_path / ("back.h5" if "hdf5" in to else "back"))
    assert main(["convert", path, "-o", str(plain)]) == 0
    assert main(["convert", str(plain), "-o", back, "--to", to, "--atom-numb-pad", "8"]) == 0
    entries = sorted(os.listdir(plain))
    originals = {s.path.rpartition("[")[2].rstrip("]"): s for s in open_systems(path, MODEL_MAP)}
    assert entries == sorted(originals)
    converted = open_all(expand_systems([back]), MODEL_MAP)
    assert sorted(s.path.rpartition("/")[2].partition("[")[0] for s in converted) == [
        "16",
        "16",
        "16",
    ]
    for system in converted:
        original = originals[system.path.rpartition("[")[2].rstrip("]")]
        a, b = original.frames(range(original.nframes)), system.frames(range(system.nframes))
        for key in a:
            np.testing.assert_allclose(b[key], a[key], rtol=0, atol=0)
        np.testing.assert_array_equal(system.atype, original.atype)
    reader = "deepmd/hdf5/mixed" if "hdf5" in to else "deepmd/npy/mixed"
    theirs = dpdata.MultiSystems.from_file(back, fmt=reader)
    assert sum(s.get_nframes() for s in theirs) == 9 and len(theirs) == 3
    close_h5()


def test_other_per_atom_arrays_follow_the_real_atoms(mixed):
    """Arrays mdtrain may read besides coord and force (atom_pref, drdq, ...) are per atom
    slot in the files: a composition gives them for its real atoms, in its atom order."""
    path, data = mixed
    slots = np.arange(12, dtype=np.float64)
    for set_name, rows in (
        ("set.000", slice(0, 4)),
        ("set.001", slice(4, 8)),
        ("set.002", slice(8, 9)),
    ):
        nframes = len(data["coords"][rows])
        pref = np.tile(slots, (nframes, 1)) + 100 * np.arange(nframes)[:, None]
        np.save(os.path.join(path, set_name, "atom_pref.npy"), pref)
        np.save(os.path.join(path, set_name, "fparam.npy"), np.ones((nframes, 2)))
    expected = _expected(data, MODEL_MAP)
    for system, group in zip(open_systems(path, MODEL_MAP), expected.values(), strict=True):
        store = system.store
        for info in system.sets:
            shape, _ = store.header(info.name, "atom_pref")
            assert shape == (info.nframes, system.natoms)
            assert store.header(info.name, "fparam")[0] == (info.nframes, 2)
            got = store.rows(info.name, "atom_pref", np.arange(info.nframes))
            frames = system.source_frames(info, np.arange(info.nframes))
            for k, frame in enumerate(frames):
                atoms = group["atoms"][group["frames"].index(frame)]
                row = frame - int(info.name[-3:]) * 4
                # the store lists them by the file's types; the System reorders by model type
                np.testing.assert_array_equal(got[k][system.atom_order], slots[atoms] + 100 * row)
    np.save(os.path.join(path, "set.000", "atom_pref.npy"), np.ones((4, 13)))
    with pytest.raises(MDTrainError, match=r"atom_pref.npy: shape \[4, 13\] does not match"):
        open_systems(path, MODEL_MAP)[0].store.header("set.000", "atom_pref")


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_reads_what_dpdata_writes(tmp_path, fmt):
    """dpdata's own mixed-type writers (``deepmd/npy/mixed``, ``deepmd/hdf5/mixed``, padded
    with virtual atoms): the frames of each composition come back as written."""
    systems = []
    for k, (nmol, ncomp) in enumerate([(3, 1), (4, 2)]):
        data = mixed_labeled(nframes=4, nmol=nmol, seed=k, ncomp=ncomp)
        folder = write_npy_system(tmp_path / f"plain{k}", **data | {"real_types": None})
        for system in open_systems(folder, ["O", "H", "X"]):
            frames = system.frames(np.arange(system.nframes))
            systems.append((system, frames))
    multi = dpdata.MultiSystems(type_map=["O", "H", "X"])
    for system, frames in systems:
        names = ["O", "H", "X"]
        multi.append(
            dpdata.LabeledSystem(
                data={
                    "atom_names": names,
                    "atom_numbs": np.bincount(system.atype, minlength=3).tolist(),
                    "atom_types": system.atype,
                    "coords": frames["coord"],
                    "cells": frames["box"],
                    "energies": frames["energy"],
                    "forces": frames["force"],
                    "virials": frames["virial"],
                    "orig": np.zeros(3),
                }
            )
        )
    out = str(tmp_path / ("dp.h5" if fmt == "hdf5" else "dp"))
    getattr(multi, f"to_deepmd_{fmt}_mixed")(out, atom_numb_pad=8)
    read = {s.path.rpartition("[")[2]: s for s in open_all(expand_systems([out]), ["O", "H", "X"])}
    assert len(read) == len(systems)
    for system, frames in systems:
        label = "".join(
            f"{n}{c}" for n, c in zip("OHX", np.bincount(system.atype, minlength=3)) if c
        )
        got = read[f"{label}]"]
        assert got.natoms == system.natoms and got.nframes == system.nframes
        back = got.frames(np.arange(got.nframes))
        for key in frames:
            np.testing.assert_allclose(back[key], frames[key], rtol=1e-6, atol=1e-6)
    close_h5()


def test_type_raw_placeholders_are_not_read_as_elements(tmp_path):
    """dpdata's type.raw of zeros names type_map.raw's first element, which the frames
    need not hold (nor the model's type_map)."""
    data = mixed_labeled(nframes=3)
    real = data["real_types"]
    data["real_types"] = np.where(real >= 0, real + 1, -1)
    data["type_map"] = ["Zz", *data["type_map"]]
    path = write_npy_system(tmp_path / "mixed", **data)
    assert [s.nframes for s in open_systems(path, ["O", "H", "X"])] == [1, 1, 1]


def test_atomic_tensors_of_a_mixed_system_cover_every_atom_slot(mixed):
    """A dipole model's sel_type leaves a mixed-type system's atomic tensor files as they
    are (every atom slot, read for the real atoms); rows for some atoms only are refused,
    since the selected atoms change from frame to frame."""
    path, data = mixed
    model = {"type_map": MODEL_MAP, "fitting_net": {"type": "dipole", "sel_type": [0]}}
    outputs = output_labels(model)
    assert outputs.sel_type == (0,)
    for set_name, n in (("set.000", 4), ("set.001", 4), ("set.002", 1)):
        values = np.arange(n * 36, dtype=np.float64).reshape(n, 36)
        np.save(os.path.join(path, set_name, "atomic_dipole.npy"), values)
    plain = open_systems(path, MODEL_MAP)
    with_sel = open_systems(path, MODEL_MAP, outputs)
    for a, b in zip(plain, with_sel, strict=True):
        frames = range(a.nframes)
        np.testing.assert_array_equal(
            a.frames(frames)["atomic_dipole"], b.frames(frames)["atomic_dipole"]
        )
    np.save(os.path.join(path, "set.000", "atomic_dipole.npy"), np.ones((4, 15)))
    with pytest.raises(MDTrainError, match=r"atomic_dipole.npy: shape \[4, 15\] does not match"):
        open_systems(path, MODEL_MAP, outputs)


def test_found_when_opened_for_positions_only(mixed):
    """``neighbor-stat`` opens systems for their positions, asking whether the first set
    holds real_atom_types.npy without listing the set: the same compositions."""
    path, _ = mixed
    listings: dict = {}
    (found,) = expand_systems(path, "/", listings)
    quick = open_all([found], MODEL_MAP, positions_only=True, listings=listings)
    full = open_systems(path, MODEL_MAP)
    assert [s.path for s in quick] == [s.path for s in full] and len(full) > 1
    assert [s.fingerprint() for s in quick] == [s.fingerprint() for s in full]
