"""``mdtrain model-devi`` against DeePMD-kit's ``dp model-devi`` on the same models and data.

A committee of plain tanh float64 models (three of one architecture, a fourth with another
rcut and sel) is written as ``.dp`` files, converted by DeePMD-kit (``dp convert-backend``)
to TensorFlow ``.pb`` files, and both tools compute the deviations on deepmd/npy systems
(atoms not sorted by type, several sets, one non-periodic): headers, steps and every column
must be the same to the printed precision, with ``--atomic -f``, and with ``--relative`` and
``--relative-v`` on a system of one-frame sets (DeePMD-kit 3.2.0's own ``--relative_v``
fails to broadcast on sets of several frames; the definition is its documented one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mdtrain.cli import main
from tests.helpers.committee import (
    DEEPMD_HEADER,
    assert_printed_equal,
    member_model,
    read_model_devi,
    write_model,
)
from tests.helpers.datagen import random_water_like, write_npy_system

pytestmark = pytest.mark.interop
TYPE_MAP = ["O", "H"]


@pytest.fixture(scope="module")
def setup(deepmd, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("model_devi")
    models = [member_model(k) for k in range(3)] + [member_model(3, rcut=3.5, sel=[12, 24])]
    for k, model in enumerate(models):
        write_model(model, tmp / f"m{k}.dp")
    errors = deepmd.driver({"convert": [[f"m{k}.dp", f"m{k}.pb"] for k in range(4)]}, tmp)
    assert errors == {}, errors
    coords, types, boxes = random_water_like(5, 8, 6.5, seed=3, triclinic=True)
    write_npy_system(tmp / "data" / "periodic", coords, types, TYPE_MAP, boxes, set_size=2)
    coords, types, _ = random_water_like(4, 8, 6.5, seed=4)
    write_npy_system(tmp / "data" / "cluster", coords, types, TYPE_MAP, None, set_size=3)
    coords, types, boxes = random_water_like(3, 8, 6.5, seed=5, triclinic=True)
    write_npy_system(tmp / "single" / "frames", coords, types, TYPE_MAP, boxes, set_size=1)
    return tmp


def both(deepmd, tmp: Path, data: str, name: str, *options: str) -> tuple[list, list]:
    """``dp model-devi`` on the .pb files and ``mdtrain model-devi`` on the .dp files, same
    data and options; their blocks (read_model_devi) by system folder name, sorted."""
    pb = [f"m{k}.pb" for k in range(4)]
    deepmd.dp_cmd(["model-devi", "-m", *pb, "-s", data, "-o", f"dp_{name}.out", *options], tmp)
    ours = tmp / f"md_{name}.out"
    dp_models = [str(tmp / f"m{k}.dp") for k in range(4)]
    assert main(["model-devi", "-m", *dp_models, "-s", str(tmp / data), "-o", str(ours),
                 *options]) == 0  # fmt: skip

    def by_name(blocks):
        return sorted(blocks, key=lambda block: Path(block[0]).name)

    return by_name(read_model_devi(tmp / f"dp_{name}.out")), by_name(read_model_devi(ours))


def assert_same(theirs: list, ours: list) -> None:
    assert [Path(t).name for t, _, _ in ours] == [Path(t).name for t, _, _ in theirs]
    for (_, their_names, their_rows), (_, names, rows) in zip(theirs, ours):
        assert names == their_names
        np.testing.assert_array_equal(rows[:, 0], their_rows[:, 0])
        assert_printed_equal(rows[:, 1:], their_rows[:, 1:])


def test_columns_equal_dp_model_devi(deepmd, setup):
    theirs, ours = both(deepmd, setup, "data", "plain")
    assert len(ours) == 2 and ours[0][1] == DEEPMD_HEADER
    assert_same(theirs, ours)


def test_atomic_and_frequency_equal_dp_model_devi(deepmd, setup):
    theirs, ours = both(deepmd, setup, "data", "atomic", "--atomic", "-f", "10")
    assert ours[0][2].shape[1] == 8 + 24
    assert_same(theirs, ours)


def test_relative_equal_dp_model_devi(deepmd, setup):
    options = ("--relative", "1.0", "--relative_v", "0.5", "--atomic")
    theirs, ours = both(deepmd, setup, "single", "relative", *options)
    assert_same(theirs, ours)
