"""Tensor label files (``dipole.npy``, ``atomic_dipole.npy``, ``polarizability.npy``,
``atomic_polarizability.npy``): read in the model's atom order, shapes checked when the
system is opened, a wrong width one line naming the file."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.data import open_system
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
