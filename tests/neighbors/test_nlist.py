"""Neighbour pairs and padded neighbour lists against independent references:
a brute-force loop over periodic images (numpy) and ASE's ``neighbor_list``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from ase.neighborlist import primitive_neighbor_list

from mdtrain.neighbors import nlist as nlist_module
from mdtrain.neighbors.nlist import NeighborSearch, build_nlist, neighbor_pairs
from tests.helpers.reference import brute_force_pairs, random_cell


def as_rows(pairs):
    return [
        (int(i), int(j), *map(int, s), float(d))
        for i, j, s, d in zip(pairs.i, pairs.j, pairs.shift, pairs.dist, strict=True)
    ]


def assert_same_pairs(got, want):
    got, want = sorted(got), sorted(want)
    assert [g[:5] for g in got] == [w[:5] for w in want]
    np.testing.assert_allclose([g[5] for g in got], [w[5] for w in want], rtol=1e-12)


CELL_CASES = {
    "large": (9.0, 10.0, 11.0),  # every length above 2·rcut
    "below_2rcut": (5.5, 9.0, 7.0),  # one length between rcut and 2·rcut
    "below_rcut": (2.2, 7.0, 3.1),  # lengths shorter than rcut: own images are neighbours
}


@pytest.mark.parametrize("case", sorted(CELL_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pairs_match_brute_force_and_ase(case, seed):
    rng = np.random.default_rng(seed)
    rcut = 4.0
    cell = random_cell(rng, CELL_CASES[case])
    natoms = 7
    # fractional coordinates partly outside [0, 1): positions need not be wrapped
    coord = rng.uniform(-0.3, 1.3, size=(natoms, 3)) @ cell
    pairs = neighbor_pairs(coord, cell, rcut)
    got = as_rows(pairs)
    assert_same_pairs(got, brute_force_pairs(coord, cell, rcut))

    i, j, shift, dist = primitive_neighbor_list(
        "ijSd", pbc=[True] * 3, cell=cell, positions=coord, cutoff=rcut
    )
    ase_rows = [
        (int(a), int(b), *map(int, s), float(d))
        for a, b, s, d in zip(i, j, shift, dist, strict=True)
    ]
    assert_same_pairs(got, [r for r in ase_rows if r[5] < rcut])
    # shifts reproduce the distances
    vec = coord[pairs.j] + pairs.shift @ cell - coord[pairs.i]
    np.testing.assert_allclose(np.linalg.norm(vec, axis=1), pairs.dist, rtol=1e-12)
    if case == "below_rcut":
        assert any(r[0] == r[1] for r in got), "own periodic images must be listed"


def test_pairs_non_periodic():
    rng = np.random.default_rng(5)
    coord = rng.uniform(0, 8, size=(20, 3))
    pairs = neighbor_pairs(coord, None, 3.5)
    assert not pairs.shift.any()
    assert_same_pairs(as_rows(pairs), brute_force_pairs(coord, None, 3.5))


def test_cutoff_is_strict():
    rcut = 3.0
    coord = np.array([[0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 2.999999, 0.0]])
    pairs = neighbor_pairs(coord, None, rcut)
    assert sorted(zip(pairs.i.tolist(), pairs.j.tolist(), strict=True)) == [(0, 2), (2, 0)]


def test_half_list_counts_match_full_list():
    rng = np.random.default_rng(3)
    cell = random_cell(rng, (2.5, 4.0, 6.0))
    coord = rng.uniform(0, 1, size=(5, 3)) @ cell
    search = NeighborSearch(4.5)
    fi, fj, _, fd = search.compute(coord, cell, full=True, shifts=False)
    hi, hj, hs, hd = search.compute(coord, cell, full=False, shifts=True)
    assert len(fi) == 2 * len(hi)
    full_counts = np.bincount(fi, minlength=5)
    half_counts = np.bincount(np.concatenate((hi, hj)), minlength=5)
    np.testing.assert_array_equal(full_counts, half_counts)
    assert fd.min() == hd.min()


def test_threaded_search_gives_the_same_pairs():
    rng = np.random.default_rng(8)
    cell = random_cell(rng, (9.0, 9.5, 10.0))
    coord = rng.uniform(0, 1, size=(150, 3)) @ cell
    single = as_rows(NeighborSearch(4.0).pairs(coord, cell))
    assert_same_pairs(as_rows(NeighborSearch(4.0, threads=3).pairs(coord, cell)), single)


def test_search_is_reused_and_rcut_respected():
    rng = np.random.default_rng(4)
    cell = random_cell(rng, (8.0, 8.0, 8.0))
    for rcut in (2.0, 3.0, 2.0):
        coord = rng.uniform(0, 1, size=(30, 3)) @ cell
        assert_same_pairs(
            as_rows(neighbor_pairs(coord, cell, rcut)), brute_force_pairs(coord, cell, rcut)
        )


def test_fallback_to_python_package_gives_the_same_pairs(monkeypatch):
    rng = np.random.default_rng(6)
    cell = random_cell(rng, (3.0, 6.0, 7.0))
    coord = rng.uniform(0, 1, size=(6, 3)) @ cell
    want = as_rows(NeighborSearch(4.0).pairs(coord, cell))
    monkeypatch.setattr(nlist_module, "_get_binding", lambda: None)
    search = NeighborSearch(4.0)
    assert search._binding is None
    assert_same_pairs(as_rows(search.pairs(coord, cell)), want)


@pytest.mark.parametrize("binding", ["compiled", "python package"])
def test_half_vectors_are_the_shifted_differences(monkeypatch, binding):
    """The library's vectors equal coord[j] - coord[i] + shift @ cell for the same pairs
    (small cell: self-images and several images of one neighbour)."""
    rng = np.random.default_rng(11)
    cell = random_cell(rng, (3.0, 5.0, 6.5))
    coord = rng.uniform(0, 1, size=(7, 3)) @ cell
    if binding != "compiled":
        monkeypatch.setattr(nlist_module, "_get_binding", lambda: None)
    search = NeighborSearch(4.0)
    i, j, shift, dist = search.compute(coord, cell, full=False, shifts=True)
    vi, vj, vec, vdist = (a.copy() for a in search.half_vectors(coord, cell))
    np.testing.assert_array_equal(vi, i)
    np.testing.assert_array_equal(vj, j)
    np.testing.assert_array_equal(vdist, dist)
    np.testing.assert_allclose(vec, coord[j] - coord[i] + shift @ cell, rtol=0, atol=1e-13)
    np.testing.assert_allclose(np.linalg.norm(vec, axis=1), dist, rtol=1e-14)


def test_search_error_is_a_value_error():
    with pytest.raises(ValueError, match="shape"):
        neighbor_pairs(np.zeros((4, 2)), None, 3.0)


def test_importing_neighbors_does_not_import_torch():
    code = (
        "import sys, numpy as np\n"
        "import mdtrain.neighbors.stat\n"
        "from mdtrain.neighbors.nlist import neighbor_pairs\n"
        "neighbor_pairs(np.random.rand(5, 3) * 3, np.eye(3) * 3, 2.0)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'vesin' not in sys.modules, 'vesin package imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------
# build_nlist


def _reference_nlist(coord, box, atype, rcut, sel):
    """Per-centre, per-type sorted (dist, j, shift) lists from the brute-force pairs."""
    ntypes = len(sel)
    lists = {(i, t): [] for i in range(len(atype)) for t in range(ntypes)}
    for i, j, s0, s1, s2, d in brute_force_pairs(coord, box, rcut):
        lists[(i, int(atype[j]))].append((d, j, (s0, s1, s2)))
    for value in lists.values():
        value.sort()
    return lists


@pytest.mark.parametrize("periodic", [True, False])
def test_build_nlist_layout(periodic):
    rng = np.random.default_rng(11)
    rcut = 3.6
    cell = random_cell(rng, (3.0, 5.0, 6.5)) if periodic else None
    natoms = 9
    span = cell if periodic else np.eye(3) * 4.0
    coord = rng.uniform(0, 1, size=(natoms, 3)) @ span
    atype = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2])
    sel = [2, 3, 4]  # small on purpose: some blocks are truncated, others padded
    nlist, shift, counts = build_nlist(coord, cell, atype, rcut, sel)
    nnei = sum(sel)
    assert nlist.shape == (natoms, nnei) and shift.shape == (natoms, nnei, 3)
    reference = _reference_nlist(coord, cell, atype, rcut, sel)
    offsets = np.cumsum([0] + sel)
    box = cell if periodic else np.zeros((3, 3))
    truncated = padded = 0
    for i in range(natoms):
        for t in range(len(sel)):
            ref = reference[(i, t)]
            assert counts[i, t] == len(ref)
            block = slice(offsets[t], offsets[t + 1])
            idx, shf = nlist[i, block], shift[i, block]
            n_ok = min(len(ref), sel[t])
            truncated += len(ref) > sel[t]
            padded += len(ref) < sel[t]
            assert (idx[n_ok:] == -1).all() and not shf[n_ok:].any()
            assert (atype[idx[:n_ok]] == t).all()
            dist = np.linalg.norm(coord[idx[:n_ok]] + shf[:n_ok] @ box - coord[i], axis=1)
            np.testing.assert_allclose(dist, [d for d, _, _ in ref[:n_ok]], rtol=1e-12)
            assert np.all(np.diff(dist) >= -1e-12)
    assert truncated and padded, "the case should exercise both truncation and padding"


def test_build_nlist_no_neighbours():
    coord = np.array([[0.0, 0.0, 0.0], [10.0, 0.0, 0.0]])
    nlist, shift, counts = build_nlist(coord, None, np.array([0, 1]), 3.0, [2, 2])
    assert (nlist == -1).all() and not shift.any() and not counts.any()
