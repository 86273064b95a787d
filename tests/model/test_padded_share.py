"""The padded slots' share of T on the compiled kernels (``kernel_nodes._PaddedShare``) against
the PyTorch operations it replaces (``kernel_nodes.padded_share``: the same bits, values and
gradients) and against a brute-force sum, with a float64 gradcheck."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from mdtrain.model.accel import kernels
from mdtrain.model.accel.kernel_nodes import _PaddedShare, padded_share

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler"
)


def _inputs(dtype, types=2, cols=7, axes=4, m=12, centres=23, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(types, cols, axes, generator=gen, dtype=dtype)
    g = torch.randn(types * cols, m, generator=gen, dtype=dtype)
    first = torch.randint(0, cols + 1, (centres,), generator=gen)  # cols: no padded column
    first[:2] = torch.tensor([0, cols])
    kind = torch.randint(0, types, (centres,), generator=gen)
    return rows, g, first, kind


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("axes", [4, 2])
def test_padded_share_node_gives_the_pytorch_operations_bits(dtype, axes):
    rows, g, first, kind = _inputs(dtype, axes=axes, cols=38, m=100, centres=192)
    lib = kernels.load_kernels()
    outs, grads = [], []
    for compiled in (False, True):
        r, w = rows.clone().requires_grad_(True), g.clone().requires_grad_(True)
        out = (
            _PaddedShare.apply(r, w, first, kind, lib)
            if compiled
            else padded_share(r, w, first, kind)
        )
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        out.backward(cot)
        outs.append(out.detach())
        grads.append((r.grad, w.grad))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])


def test_padded_share_node_is_the_sum_over_each_centres_padded_columns():
    rows, g, first, kind = _inputs(torch.float64)
    out = _PaddedShare.apply(rows, g, first, kind, kernels.load_kernels())
    gv = g.view(rows.shape[0], rows.shape[1], -1)
    for c in range(first.shape[0]):
        t, f = int(kind[c]), int(first[c])
        expected = sum(
            (torch.outer(rows[t, k], gv[t, k]) for k in range(f, rows.shape[1])),
            torch.zeros(rows.shape[2], gv.shape[2], dtype=torch.float64),
        )
        torch.testing.assert_close(out[c], expected, rtol=1e-12, atol=1e-12)


def test_padded_share_node_gradcheck():
    rows, g, first, kind = _inputs(torch.float64, cols=5, m=3, centres=9)
    lib = kernels.load_kernels()
    r, w = rows.requires_grad_(True), g.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: _PaddedShare.apply(a, b, first, kind, lib), (r, w))
