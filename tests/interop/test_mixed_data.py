"""Mixed-type data against DeePMD-kit: ``dp neighbor-stat`` (per type, and ``--mixed-type``:
all types together) on mixed-type systems mdtrain's tests write and ``mdtrain convert``
writes (padded with virtual atoms), and mdtrain's figures on the same data."""

from __future__ import annotations

import re

import pytest

from mdtrain.cli import main
from tests.helpers.datagen import MIXED_TYPE_MAP, mixed_labeled, write_npy_system

pytestmark = pytest.mark.interop
RCUT = 4.0


def _dp_sizes(deepmd, system: str, cwd, mixed: bool) -> list[int]:
    args = ["dp", "neighbor-stat", "-s", system, "-r", str(RCUT), "-t", *MIXED_TYPE_MAP]
    output = deepmd.run([*args, "--mixed-type"] if mixed else args, cwd)
    found = re.findall(r"max_nbor_size: \[([0-9 ]+)\]", output)
    assert found, output
    return [int(n) for n in found[-1].split()]


def test_neighbor_stat_agrees_with_deepmd(deepmd, tmp_path, capsys):
    data = mixed_labeled(nframes=6, virtual=True, rcut=RCUT)
    write_npy_system(tmp_path / "data" / "mixed", set_size=4, **data)
    assert main(["convert", str(tmp_path / "data"), "-o", str(tmp_path / "padded.h5"),
                 "--to", "deepmd/hdf5/mixed", "--atom-numb-pad", "8"]) == 0  # fmt: skip
    for system in ("data/mixed", "padded.h5"):
        capsys.readouterr()
        assert main(["neighbor-stat", "-s", str(tmp_path / system), "-r", str(RCUT),
                     "-t", *MIXED_TYPE_MAP, "-o", str(tmp_path / "n.json")]) == 0  # fmt: skip
        out = capsys.readouterr().out
        per_type = re.search(r"max_nbor_size: \[([0-9, ]+)\]", out).group(1)
        total = int(re.search(r"max_nbor_total: (\d+)", out).group(1))
        assert _dp_sizes(deepmd, system, tmp_path, mixed=False) == [
            int(n) for n in per_type.split(",")
        ]
        assert _dp_sizes(deepmd, system, tmp_path, mixed=True) == [total]
