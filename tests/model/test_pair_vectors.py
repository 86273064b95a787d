"""The compiled pair vectors (``mdtrain.model.accel.pair_vectors``, the ``kernels`` backend's)
against ``conservative.pair_vectors``'s torch operations: the same bits, for triclinic cells
with image shifts of several cells, without a cell, on one and on two threads; and the
explicit model takes them only where it can."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from mdtrain.model.accel.kernels import load_kernels
from mdtrain.model.accel.pair_vectors import CompiledPairVectors
from mdtrain.model.backend import build_model
from mdtrain.model.conservative import pair_vectors
from tests.helpers.models import small_config, water_batch

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler"
)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_random_inputs_bit_identical(threads):
    """Random positions, lists with padding, shifts of up to three cells, skewed cells of
    either sign: every product and sum rounds as torch's."""
    compiled = CompiledPairVectors(load_kernels().lib)
    gen = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for nf, natoms, nnei in [(1, 192, 138), (3, 17, 9), (2, 1, 1)]:
            coord = (torch.rand(nf, natoms, 3, generator=gen, dtype=torch.float64) - 0.3) * 15
            nlist = torch.randint(-1, natoms, (nf, natoms, nnei), generator=gen)
            shift = torch.randint(-3, 4, (nf, natoms, nnei, 3), generator=gen).double()
            box = (torch.rand(nf, 3, 3, generator=gen, dtype=torch.float64) - 0.5) * 20
            assert _bits_equal(
                compiled(coord, box, nlist, shift), pair_vectors(coord, box, nlist, shift)
            )
            assert _bits_equal(
                compiled(coord, None, nlist, shift), pair_vectors(coord, None, nlist, shift)
            )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("periodic", [True, False])
def test_water_frames_and_the_model_choice(periodic):
    """On real lists (int64 shifts of a triclinic cell), the kernels backend's model gives
    torch's vectors; positions that need a graph take the torch operations."""
    config = small_config()
    model = build_model(config, backend="kernels")
    assert model.vectors is not None
    assert build_model(config, backend="fused").vectors is None
    coord, atype, box, nlist, shift = water_batch(
        model.rcut, model.sel, nframes=2, nmol=8, edge=6.0, periodic=periodic, seed=4
    )
    cell = None if box is None else box.double()
    got = model.pair_vectors(coord.double(), cell, nlist, shift)
    assert _bits_equal(got, pair_vectors(coord.double(), cell, nlist, shift))
    x = coord.double().requires_grad_(True)
    with_graph = model.pair_vectors(x, cell, nlist, shift)
    assert with_graph.requires_grad  # the torch operations: a graph to the positions
    assert _bits_equal(with_graph.detach(), got)
    assert copy.deepcopy(model.vectors) is model.vectors  # the library is shared, not copied
