"""Tensor label files (``dipole.npy``, ``atomic_dipole.npy``, ``polarizability.npy``,
``atomic_polarizability.npy``): read in the model's atom order, shapes checked when the
system is opened, a wrong width one line naming the file."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.data import open_system
from mdtrain.data.labels import output_labels
from mdtrain.errors import MDTrainError
from tests.helpers.datagen import random_water_like, tensor_labels, write_npy_system


def _system(tmp_path, **override):
    coords, types, boxes = random_water_like(3, 4, 6.0, seed=1)
    labels = tensor_labels(coords, types)
    labels.update(override)
    path = write_npy_system(tmp_path / "sys", coords, types, ["O", "H"], boxes, extra=labels)
    return path, coords, types, labels


def test_labels_come_in_the_models_atom_order(tmp_path):
    path, coords, types, labels = _system(tmp_path)
    system = open_system(path, ["O", "H"])
    order = np.argsort(types, kind="stable")
    for name in ("dipole", "polarizability", "atomic_dipole", "atomic_polarizability"):
        assert system.has(name)
    frames = system.frames([2, 0])
    np.testing.assert_array_equal(frames["dipole"], labels["dipole"][[2, 0]])
    np.testing.assert_array_equal(frames["polarizability"], labels["polarizability"][[2, 0]])
    want = labels["atomic_dipole"][[2, 0]][:, order]
    np.testing.assert_array_equal(frames["atomic_dipole"], want)
    assert frames["atomic_polarizability"].shape == (2, 12, 9)
    np.testing.assert_array_equal(frames["coord"], coords[[2, 0]][:, order])
    # the sorted atoms' labels: oxygens (first after sorting) carry them, hydrogens zero
    assert np.all(frames["atomic_dipole"][:, 4:] == 0) and np.all(
        frames["atomic_dipole"][:, :4] != 0
    )


@pytest.mark.parametrize(
    ("name", "values", "expected"),
    [
        ("dipole", np.zeros((3, 4)), "[nframes, 3]"),
        ("atomic_polarizability", np.zeros((3, 9 * 4)), "[nframes, 108]"),
    ],
)
def test_a_label_of_the_wrong_width_is_one_line(tmp_path, name, values, expected):
    path, *_ = _system(tmp_path, **{name: values})
    with pytest.raises(MDTrainError) as err:
        open_system(path, ["O", "H"])
    message = str(err.value)
    assert "\n" not in message and f"{name}.npy" in message and expected in message
    assert "sys" in message and "set.000" in message


# -- atomic labels of the sel_type atoms only (DeePMD-kit's DPLR layout) -------------------

_DIPOLE_O = output_labels(
    {"type_map": ["O", "H"], "fitting_net": {"type": "dipole", "sel_type": [0]}}
)


def _selected_only(labels: dict, types: np.ndarray) -> dict:
    """The atomic labels as DeePMD-kit's DPLR data stores them: the oxygens' rows only, in
    the file's atom order."""
    return {k: v[:, types == 0] for k, v in labels.items() if k.startswith("atomic_")}


def _atomic_labels(coords: np.ndarray, types: np.ndarray) -> dict:
    """Atomic labels that differ from atom to atom and frame to frame, zero on hydrogens
    (the all-atom layout of labels that only oxygens carry)."""
    nf, natoms = coords.shape[:2]
    oxygen = (types == 0)[None, :, None]
    dipole = coords * 0.5 + np.arange(natoms)[None, :, None]
    polar = np.concatenate([coords] * 3, axis=2) - np.arange(natoms)[:, None]
    return {"atomic_dipole": dipole * oxygen, "atomic_polarizability": polar * oxygen}


def test_selected_atoms_only_read_as_all_atoms(tmp_path):
    coords, types, boxes = random_water_like(3, 4, 6.0, seed=1)
    types = types[::-1].copy()  # H H O ...: sorting by type moves every oxygen
    labels = _atomic_labels(coords, types)
    full = write_npy_system(tmp_path / "full", coords, types, ["O", "H"], boxes, extra=labels)
    only = _selected_only(labels, types)
    assert only["atomic_dipole"].shape == (3, 4, 3)
    sel = write_npy_system(tmp_path / "sel", coords, types, ["O", "H"], boxes, extra=only)
    want = open_system(full, ["O", "H"], _DIPOLE_O).frames([2, 0, 1])
    got = open_system(sel, ["O", "H"], _DIPOLE_O).frames([2, 0, 1])
    for name in ("atomic_dipole", "atomic_polarizability"):
        np.testing.assert_array_equal(got[name], want[name])
        assert np.all(got[name][:, :4] != 0) and np.all(got[name][:, 4:] == 0)
    # the model numbers the elements the other way round: the same atoms, sorted last
    model = {"type_map": ["H", "O"], "fitting_net": {"type": "polar", "sel_type": [1]}}
    got = open_system(sel, ["H", "O"], output_labels(model)).frames([1])
    np.testing.assert_array_equal(
        got["atomic_polarizability"][0, 8:], want["atomic_polarizability"][2, :4]
    )


def test_selected_layout_needs_the_models_sel_type(tmp_path):
    coords, types, boxes = random_water_like(3, 4, 6.0, seed=1)
    only = _selected_only(tensor_labels(coords, types), types)
    path = write_npy_system(tmp_path / "sys", coords, types, ["O", "H"], boxes, extra=only)
    with pytest.raises(
        MDTrainError,
        match=r"atomic_dipole\.npy: shape \[3, 12\] does not match \[nframes, 36\] \(12 atoms in type.raw\)$",
    ):
        open_system(path, ["O", "H"])


@pytest.mark.parametrize("width", [5 * 3, 36 + 3])
def test_neither_layout_names_both_shapes(tmp_path, width):
    coords, types, boxes = random_water_like(3, 4, 6.0, seed=1)
    extra = {"atomic_dipole": np.zeros((3, width))}
    path = write_npy_system(tmp_path / "sys", coords, types, ["O", "H"], boxes, extra=extra)
    with pytest.raises(MDTrainError) as err:
        open_system(path, ["O", "H"], _DIPOLE_O)
    message = str(err.value)
    assert "\n" not in message and "sys/set.000/atomic_dipole.npy" in message
    assert (
        "[nframes, 36] (12 atoms in type.raw) or [nframes, 12] (its 4 atoms of sel_type)" in message
    )
