"""The fitting node with compiled elementwise loops (``accel.fitting_compiled``) against the
plain node (``accel.fitting_node``, itself checked against autograd's double backward in
``test_backends.py``): equal bit for bit, one net and K stacked, and against finite
differences (gradcheck); and which backend gets which node."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from mdtrain.model.accel.fitting_compiled import (
    CompiledFittingNode,
    fitting_node_for,
    plain_fitting_node,
)
from mdtrain.model.accel.layout import layer_layout, layer_params
from mdtrain.model.backend import build_model
from mdtrain.model.network import FittingNet
from tests.helpers.models import small_config

HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler")

# (n_in, neuron, resnet_dt): every skip kind (none, + x, + concat(x, x)), with and without idt
NETS = [(12, [24, 24, 24], True), (8, [8, 16, 16, 8], True), (6, [6, 12], False), (5, [7], True)]


def _compiled() -> CompiledFittingNode:
    from mdtrain.model.accel.kernel_nodes import KernelEmbedding
    from mdtrain.model.accel.kernels import load_kernels

    node = fitting_node_for(KernelEmbedding(load_kernels()))
    assert isinstance(node, CompiledFittingNode)
    return node


def _params(net: FittingNet, k: int | None) -> list[torch.Tensor]:
    """The net's parameters, or K perturbed copies stacked as the committee stacks them."""
    params = [p.detach() for p in layer_params(net.layers)]
    if k is None:
        return params
    gen = torch.Generator().manual_seed(2)
    stacked = [torch.stack([p + 0.1 * torch.randn(p.shape, generator=gen) for _ in range(k)])
               for p in params]  # fmt: skip
    return [p.unsqueeze(1) if p.dim() == 2 else p for p in stacked]


def _run(node, x, layout, params, cot_e, cot_g):
    x = x.clone().requires_grad_(True)
    params = [p.clone().requires_grad_(True) for p in params]
    energy, grad = node(x, layout, *params)
    outputs = [o for o, c in ((energy, cot_e), (grad, cot_g)) if c is not None]
    torch.autograd.backward(outputs, [c for c in (cot_e, cot_g) if c is not None])
    return [energy.detach(), grad.detach(), x.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n_in", "neuron", "resnet_dt"), NETS)
@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("cotangents", ["both", "energy", "gradient"])
def test_equals_plain_node_bit_for_bit(dtype, n_in, neuron, resnet_dt, k, cotangents):
    net = FittingNet(n_in, neuron, "tanh", resnet_dt, dtype, seed=4)
    for p in net.parameters():  # idt and biases away from their small initial values
        p.data.normal_(generator=torch.Generator().manual_seed(p.numel()))
    layout = layer_layout(net.layers[:-1])
    params = _params(net, k)
    gen = torch.Generator().manual_seed(1)
    lead = (37,) if k is None else (k, 37)
    x = torch.randn(*lead, n_in, generator=gen).to(dtype)
    cot_e = torch.randn(*lead, 1, generator=gen).to(dtype)
    cot_g = torch.randn(*lead, n_in, generator=gen).to(dtype)
    cot_e = None if cotangents == "gradient" else cot_e
    cot_g = None if cotangents == "energy" else cot_g
    got = _run(_compiled(), x, layout, params, cot_e, cot_g)
    want = _run(plain_fitting_node, x, layout, params, cot_e, cot_g)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(("n_in", "neuron", "resnet_dt"), NETS)
@pytest.mark.parametrize("k", [None, 2])
def test_gradcheck(n_in, neuron, resnet_dt, k):
    net = FittingNet(n_in, neuron, "tanh", resnet_dt, torch.float64, seed=3)
    layout = layer_layout(net.layers[:-1])
    params = [p.requires_grad_(True) for p in _params(net, k)]
    lead = (5,) if k is None else (k, 5)
    x = torch.randn(*lead, n_in, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    node = _compiled()
    assert torch.autograd.gradcheck(
        lambda x, *p: node(x, layout, *p), (x.requires_grad_(True), *params)
    )


def test_backends_get_their_node():
    """The kernels backend runs the compiled loops, the fused backend the plain node."""
    kernels = build_model(small_config(), backend="kernels")
    fused = build_model(small_config(), backend="fused")
    assert isinstance(kernels.fitting_node, CompiledFittingNode)
    assert fused.fitting_node is plain_fitting_node
