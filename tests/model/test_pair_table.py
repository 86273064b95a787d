"""Tabulated pair potentials: DeePMD-kit's numbers (the committed fixture of
``tests/fixtures/pair_table/``, made by its ``make_fixture.py`` with DeePMD-kit's numpy
implementation), the spline against an independent one, and every refusal of a bad table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mdtrain.data.pair_table import clamped_slopes, load_pair_table, read_table_file
from mdtrain.errors import MDTrainError
from mdtrain.model.combined import CombinedModel, zbl_switch
from mdtrain.model.conservative import pair_vectors
from mdtrain.model.pair_energy import PairTableEnergy
from mdtrain.neighbors.nlist import build_nlist
from tests.helpers.models import evaluate
from tests.helpers.pair_tables import write_table, zbl_table

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pair_table" / "pair_table.npz"
CASES = ["pad", "far", "near", "inside"]  # zero padding, two bridges, rcut inside the table
REL = 1e-10


@pytest.fixture(scope="module")
def ref():
    return np.load(FIXTURE)


def table_of(ref, case: str, tmp_path: Path):
    path = write_table(tmp_path / f"{case}.txt", ref[f"{case}_table"])
    return load_pair_table(path, float(ref[f"{case}_rcut"]), [str(t) for t in ref["type_map"]])


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def test_fixture_is_small():
    assert FIXTURE.stat().st_size < 100_000


@pytest.mark.parametrize("case", CASES)
def test_table_extension_is_deepmds(ref, case, tmp_path):
    table = table_of(ref, case, tmp_path)
    nraw = ref[f"{case}_table"].shape[0]
    tail = ref[f"{case}_vdata_tail"]
    assert table.vdata.shape[0] == nraw + tail.shape[0]
    if tail.size:
        np.testing.assert_allclose(table.vdata[nraw:], tail, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_pair_energies_are_deepmds(ref, case, tmp_path):
    module = PairTableEnergy(table_of(ref, case, tmp_path), [str(t) for t in ref["type_map"]], 64)
    r = torch.tensor(ref[f"{case}_scan_r"]).expand(9, -1)
    ti = torch.arange(3).repeat_interleave(3)[:, None]
    tj = torch.arange(3).repeat(3)[:, None]
    ours = module.pair_energy(r, ti, tj, torch.ones_like(r, dtype=torch.bool)).numpy()
    assert rel_diff(ours, ref[f"{case}_scan_energy"]) < REL
    assert np.count_nonzero(ref[f"{case}_scan_energy"]) > 100  # the scan is not all zeros


@pytest.mark.parametrize("case", CASES)
def test_atomic_energies_of_periodic_frames_are_deepmds(ref, case, tmp_path):
    type_map = [str(t) for t in ref["type_map"]]
    part = PairTableEnergy(table_of(ref, case, tmp_path), type_map, 300)
    model = CombinedModel([part], [1.0], type_map, {"type": "pairtab"})
    atype = ref["atype"]
    for f in range(ref["coord"].shape[0]):
        out = evaluate(model, ref["coord"][f], ref["box"][f], atype)
        assert rel_diff(out["atom_energy"], ref[f"{case}_atom_energy"][f]) < REL


def test_zbl_switch_is_deepmds(ref):
    sw_rmin, sw_rmax, alpha = (float(v) for v in ref["switch"])
    rcut, atype = float(ref["zbl_rcut"]), ref["atype"]
    weights = ref["zbl_weight"]
    assert np.any((weights > 0) & (weights < 1)) and np.any(weights == 0)
    for f in range(ref["coord"].shape[0]):
        coord, box = ref["coord"][f], ref["box"][f]
        nlist, shift, _ = build_nlist(coord, box, atype, rcut, [200, 200, 200])
        nl, sh = torch.tensor(nlist)[None], torch.tensor(shift)[None]
        diff = pair_vectors(torch.tensor(coord)[None], torch.tensor(box)[None], nl, sh)
        ours = zbl_switch(diff, nl, sw_rmin, sw_rmax, alpha)[0].numpy()
        np.testing.assert_allclose(ours, weights[f], rtol=0, atol=1e-12)


def test_clamped_spline_against_dense_solve():
    """The Thomas algorithm against the same equations solved densely, on an uneven grid."""
    rng = np.random.default_rng(0)
    x = np.cumsum(rng.uniform(0.5, 1.5, 9))
    y = rng.normal(size=(9, 2))
    n = len(x)
    a, b = np.zeros((n, n)), np.zeros((n, 2))
    a[0, 0] = a[-1, -1] = 1.0
    h = np.diff(x)
    for i in range(1, n - 1):
        a[i, i - 1], a[i, i], a[i, i + 1] = h[i], 2 * (h[i - 1] + h[i]), h[i - 1]
        d0, d1 = (y[i] - y[i - 1]) / h[i - 1], (y[i + 1] - y[i]) / h[i]
        b[i] = 3 * (h[i] * d0 + h[i - 1] * d1)
    np.testing.assert_allclose(clamped_slopes(x, y), np.linalg.solve(a, b), atol=1e-12)


# --- bad tables: one line naming the file and what is wrong ------------------------------


def _good(tmp_path: Path) -> np.ndarray:
    return zbl_table(["O", "H"], 0.2, 2.0, 0.05)


BAD = {
    "missing": (None, "no such file"),
    "word": ("0.1 1 2 x\n0.2 1 2 3\n", "line 1: 'x' is not a number"),
    "ragged": ("0.1 1 2 3\n0.2 1 2\n", "line 2 has 3 columns, the first row 4"),
    "one_row": ("0.1 1 2 3\n", "needs at least 2 rows"),
    "columns": ("0.1 1 2\n0.2 1 2\n", "2 energy columns after the distance"),
    "uneven": ("0.1 1 2 3\n0.2 1 2 3\n0.35 1 2 3\n", "evenly spaced"),
    "decreasing": ("0.2 1 2 3\n0.1 1 2 3\n", "distances must increase"),
    "nan": ("0.1 1 2 3\n0.2 1 nan 3\n", "row 2, column 3 is nan"),
    "negative": ("-0.1 1 2 3\n0.0 1 2 3\n", "negative"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_table_is_one_line_naming_file_and_fault(name, tmp_path):
    text, expected = BAD[name]
    path = tmp_path / f"{name}.txt"
    if text is not None:
        path.write_text(text)
    with pytest.raises(MDTrainError) as err:
        read_table_file(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and expected in message, message


def test_table_for_other_types_than_type_map_is_refused(tmp_path):
    path = write_table(tmp_path / "t.txt", _good(tmp_path))  # 3 columns: 2 types
    with pytest.raises(MDTrainError, match=r"table for 2 types, but type_map \['O', 'H', 'C'\]"):
        load_pair_table(path, 2.0, ["O", "H", "C"], key="model/use_srtab")
    with pytest.raises(MDTrainError, match="model/use_srtab"):
        load_pair_table(path, 2.0, ["O", "H", "C"], key="model/use_srtab")


def test_distance_below_the_table_names_the_pair_and_the_file(tmp_path):
    path = write_table(tmp_path / "t.txt", zbl_table(["O", "H"], 0.5, 2.0, 0.05))
    part = PairTableEnergy(load_pair_table(path, 2.0, ["O", "H"]), ["O", "H"], 8)
    model = CombinedModel([part], [1.0], ["O", "H"], {"type": "pairtab"})
    coord = np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 1.2], [0.0, 0.3, 0.0]])
    with pytest.raises(MDTrainError) as err:
        evaluate(model, coord, None, np.array([0, 1, 1]))
    message = str(err.value)
    assert str(path) in message and "atoms 0 (O) and 2 (H)" in message and "0.3 Å" in message
