"""The float32 path of the compiled embedding kernels against float64 references: their own
register-tiled products (``csrc/embed_tiles.h``: x·W and dx·W of each row in the forward, ā·Wᵀ
and dā·Wᵀ in the backward), with the BLAS kept where a layer is too wide for them, and the
padded slots' net run by the kernels' node (``KernelEmbedding._tail_values``). Float32 results
differ from float64 in their roundings only: compared at a float32 tolerance.
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from mdtrain.model.accel import kernel_nodes, kernels
from mdtrain.model.accel.embedding_nodes import TorchEmbedding, _EmbedContract, _RowGrad
from mdtrain.model.accel.kernel_nodes import _KernelEmbedContract, _KernelRowGrads, plan_blocks
from mdtrain.model.accel.layout import layer_layout, layer_params
from mdtrain.model.network import EmbeddingNet

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler"
)


def _nets(neuron: list[int], resnet_dt: bool) -> tuple[EmbeddingNet, EmbeddingNet]:
    """A float64 net and its float32 copy (the same parameters, rounded)."""
    net64 = EmbeddingNet(neuron, "tanh", resnet_dt, torch.float64, seed=5)
    with torch.no_grad():  # biases and idt away from their initial values
        for p in net64.parameters():
            p.add_(
                0.1
                * torch.randn(p.shape, generator=torch.Generator().manual_seed(9), dtype=p.dtype)
            )
    return net64, copy.deepcopy(net64).to(torch.float32)


def _outputs(net, rows, cot, use_kernels):
    """T, G, dG/ds, the row gradients and the parameter gradients of a loss on T and on the
    row gradients (float64 copies), through the kernels' nodes or the PyTorch ones."""
    layout, params = layer_layout(net.layers), layer_params(net.layers)
    if use_kernels:
        lib, plan = kernels.load_kernels(), plan_blocks(None, rows.shape[0], rows.shape[2])
        tmat, value, slope = _KernelEmbedContract.apply(rows, lib, plan, layout, *params)
        span = ((0, rows.shape[2], plan),)
        rbar = _KernelRowGrads.apply(
            torch.tanh(tmat), rows.transpose(1, 2), lib, span, rows.shape[1], value, slope
        )
        value, slope = (t.view(rows.shape[0], rows.shape[2], -1) for t in (value, slope))
    else:
        tmat, value, slope = _EmbedContract.apply(rows, layout, *params)
        rbar = _RowGrad.apply(torch.tanh(tmat), value, slope, rows)
    loss = (cot[0].to(rows.dtype) * tmat).sum() + (cot[1].to(rows.dtype) * rbar).sum()
    grads = torch.autograd.grad(loss, params)
    return [t.detach().double() for t in (tmat, value, slope, rbar, *grads)]


def _close_at_float32(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5 * scale)


@pytest.mark.parametrize(
    "neuron, resnet_dt",
    [
        ([25, 50, 100], False),  # water: tiles of 7 + 6 vectors forward, 7 and 4 backward
        ([25, 50, 100], True),
        ([3, 13, 26], True),  # widths not multiples of 8, the concatenating skip
        ([7, 7, 7], False),  # the adding skip
        ([5, 11, 17], True),  # no skip
        ([2, 4, 4, 8], True),  # every skip kind, narrower than one vector
        ([25, 50, 200], False),  # too wide for the tiles: the BLAS for the last layer
    ],
)
@pytest.mark.parametrize("axes, block_rows", [(4, 512), (4, 24), (2, 40)])
def test_float32_kernels_match_the_float64_pytorch_path(
    neuron, resnet_dt, axes, block_rows, monkeypatch
):
    monkeypatch.setattr(kernel_nodes, "BLOCK_ROWS", block_rows)
    net64, net32 = _nets(neuron, resnet_dt)
    gen = torch.Generator().manual_seed(3)
    rows64 = torch.randn(17, axes, 23, generator=gen, dtype=torch.float64)
    cot = [torch.randn(17, axes, neuron[-1], generator=gen, dtype=torch.float64)]
    cot.append(torch.randn(17, 23, axes, generator=gen, dtype=torch.float64))
    want = _outputs(net64, rows64, cot, use_kernels=False)
    got = _outputs(net32, rows64.float(), cot, use_kernels=True)
    _close_at_float32(got, want)


def _padded_case(dtype, axes=4, nc=11, w=15, types=2):
    """Rows (B, A, w) whose columns past each row's last neighbour are that centre type's
    padded row, the padded rows (types, w, A), centre types and the real-neighbour mask."""
    gen = torch.Generator().manual_seed(6)
    pad = torch.randn(types, w, axes, generator=gen, dtype=torch.float64)
    kind = torch.randint(0, types, (nc,), generator=gen)
    used = torch.randint(1, w - 3, (nc,), generator=gen)
    rows = torch.randn(nc, axes, w, generator=gen, dtype=torch.float64)
    col = torch.arange(w)
    mask = col.view(1, w) < used.view(nc, 1)
    rows = torch.where(mask.unsqueeze(1), rows, pad[kind].transpose(1, 2))
    return rows.to(dtype), pad.to(dtype), kind, mask, int(used.max())


def _contract(ops, net, rows, pad, kind, mask, n):
    tmat = torch.zeros(rows.shape[0], rows.shape[1], 100, dtype=rows.dtype)
    out, _ = ops.contract(net, rows, n, pad, kind, tmat, 0, 0, mask, {})
    grads = torch.autograd.grad(out.square().sum(), layer_params(net.layers))
    return [t.detach().double() for t in (out, *grads)]


@pytest.mark.parametrize("axes", [4, 2])
def test_padded_slots_net_on_the_kernels_matches_the_pytorch_path(axes):
    """``KernelEmbedding.contract``'s share of the padded slots, whose G the kernels' node
    makes in float32 (the net itself in float64), against the PyTorch path in float64."""
    net64, net32 = _nets([25, 50, 100], True)
    rows, pad, kind, mask, n = _padded_case(torch.float64, axes)
    ops = kernel_nodes.KernelEmbedding(kernels.load_kernels())
    want = _contract(TorchEmbedding(), net64, rows, pad, kind, mask, n)
    _close_at_float32(_contract(ops, net32, rows.float(), pad.float(), kind, mask, n), want)
    got64 = _contract(ops, net64, rows, pad, kind, mask, n)
    for a, b in zip(got64, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
