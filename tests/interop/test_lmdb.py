"""The LMDB layout mdtrain reads is DeePMD-kit's: DeePMD-kit 3.2's own reader
(``deepmd.dpmodel.utils.lmdb_data.LmdbDataReader``, run in its environment) reads the LMDB the
tests write (tests/helpers/lmdb.py: two compositions, stored types in the order H, O) and
gives every frame's coordinates, types (matched by name to the model's O, H), cell, energy,
forces and virial as mdtrain's systems give them."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.data import expand_systems, open_system
from tests.helpers.datagen import water_labeled
from tests.helpers.lmdb import frames_of, write_lmdb

pytestmark = pytest.mark.interop

READER = r"""
import sys
import numpy as np
from deepmd.dpmodel.utils.lmdb_data import LmdbDataReader

reader = LmdbDataReader(sys.argv[1], ["O", "H"], batch_size=1)
out = {}
for i in range(len(reader)):
    frame = reader[i]
    for key in ("coord", "atype", "box", "energy", "force", "virial"):
        out[f"{key}_{i}"] = np.asarray(frame[key])
np.savez(sys.argv[2], n=len(reader), **out)
"""


def test_deepmd_reads_the_lmdb_mdtrain_reads(deepmd, tmp_path):
    frames = []
    for nmol, seed in ((4, 1), (6, 2)):
        data = water_labeled(nframes=2, nmol=nmol, seed=seed)
        types = 1 - np.asarray(data["types"])  # H = 0, O = 1 as stored
        frames += frames_of(
            data["coords"], types, data["boxes"], data["energy"], data["force"], data["virial"]
        )
    path = write_lmdb(tmp_path / "data.lmdb", frames, ["H", "O"])
    script = tmp_path / "read.py"
    script.write_text(READER)
    deepmd.run([deepmd.python, script, path, tmp_path / "theirs.npz"], tmp_path)
    theirs = np.load(tmp_path / "theirs.npz")
    assert int(theirs["n"]) == 4

    ours = {}
    for system_path in expand_systems(path):
        system = open_system(system_path, ["O", "H"])
        got = system.frames(range(system.nframes))
        inverse = np.argsort(system.atom_order)  # back to the stored atom order
        for k, number in enumerate(system.store.frame_numbers()):
            ours[number] = {
                "coord": got["coord"][k][inverse],
                "atype": system.atype[inverse],
                "box": got["box"][k],
                "energy": got["energy"][k],
                "force": got["force"][k][inverse],
                "virial": got["virial"][k],
            }
    assert sorted(ours) == [0, 1, 2, 3]
    for i, frame in ours.items():
        for key, value in frame.items():
            np.testing.assert_array_equal(
                np.asarray(theirs[f"{key}_{i}"]).reshape(-1), np.asarray(value).reshape(-1), key
            )
