"""The compiled D = TᵀT< and dE/dT nodes (``mdtrain.model.accel.descriptor_products``) against
torch's operations they replace: the same bits forward and backward, in both precisions, on one
and two threads; their backward against finite differences; and the whole model on the
``kernels`` backend with and without them."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from mdtrain.model.accel.descriptor_products import (
    DescriptorProducts,
    _Descriptor,
    _Tbar,
    torch_descriptor_of_t,
    torch_tbar_of,
)
from mdtrain.model.accel.kernels import load_kernels
from mdtrain.model.backend import build_model
from tests.helpers.models import batch, set_random_stats, small_config

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler"
)

# where the orders are known (MKL's AVX2 kernels): the products must be found and used there
KNOWN_BLAS = torch.backends.mkl.is_available() and torch.backends.cpu.get_cpu_capability() == "AVX2"
SHAPES = [(100, 16), (16, 4), (120, 12)]  # (neuron_out, axis_neuron): water, the tests', …


def _operands(dtype, m, x, batch=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(batch, 4, m, dtype=dtype, generator=gen)
    dd = torch.randn(batch, m, x, dtype=dtype, generator=gen)
    d_bar = torch.randn(batch, m * x, dtype=dtype, generator=gen)
    g = torch.randn(batch, 4, m, dtype=dtype, generator=gen)
    return t, dd, d_bar, g


def _outputs(prod, orders, t, dd, d_bar, g, nnei=30):
    """D, dE/dT and the gradients of T and dE/dD, the nodes chained as the model chains them."""
    tmat = (t * nnei).requires_grad_()
    ddl = dd.clone().requires_grad_()
    x = dd.shape[2]
    if orders is None:
        tt = tmat / nnei
        d, tbar = torch_descriptor_of_t(tt, x), torch_tbar_of(tt, ddl, nnei)
    else:
        d, tt = _Descriptor.apply(prod, orders, x, float(nnei), tmat)
        tbar = _Tbar.apply(prod, orders, float(nnei), tt, ddl)
    return [d, tbar, *torch.autograd.grad([d, tbar], [tmat, ddl], [d_bar, g])]


def _energy_only(prod, orders, t, dd, d_bar, g, nnei=30):
    """T's gradient through D alone (a loss without forces: D's backward without dE/dT's)."""
    tmat = (t * nnei).requires_grad_()
    x = dd.shape[2]
    if orders is None:
        d = torch_descriptor_of_t(tmat / nnei, x)
    else:
        d = _Descriptor.apply(prod, orders, x, float(nnei), tmat)[0]
    return torch.autograd.grad(d, tmat, d_bar)[0]


def _forces_only(prod, orders, t, dd, d_bar, g, nnei=30):
    """T's gradient through dE/dT alone (no cotangent of D reaches D's node)."""
    tmat = (t * nnei).requires_grad_()
    x = dd.shape[2]
    if orders is None:
        tbar = torch_tbar_of(tmat / nnei, dd, nnei)
    else:
        tbar = _Tbar.apply(
            prod, orders, float(nnei), _Descriptor.apply(prod, orders, x, float(nnei), tmat)[1], dd
        )
    return torch.autograd.grad(tbar, tmat, g)[0]


def _bits_equal(a, b) -> bool:
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize("shape", SHAPES)
def test_products_bit_identical_to_torch(shape, precision, threads):
    dtype = getattr(torch, precision)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prod = DescriptorProducts(load_kernels())
        orders = prod.orders(dtype, 4, *shape)
        if KNOWN_BLAS and shape == (100, 16):
            assert orders is not None
        if orders is None:
            pytest.skip("this BLAS's summation order is not reproduced: torch's operations run")
        for seed, nb in ((1, 37), (2, 192), (3, 1)):
            ops = _operands(dtype, *shape, batch=nb, seed=seed)
            expected = _outputs(prod, None, *ops)
            got = _outputs(prod, orders, *ops)
            assert all(_bits_equal(a, b) for a, b in zip(expected, got, strict=True))
            assert _bits_equal(_energy_only(prod, None, *ops), _energy_only(prod, orders, *ops))
            assert _bits_equal(_forces_only(prod, None, *ops), _forces_only(prod, orders, *ops))
    finally:
        torch.set_num_threads(before)


def test_an_unmatched_order_keeps_torchs_operations():
    """Where no order reproduces torch's (MKL's kernels for (25, 7) sum in yet other orders),
    the descriptor runs torch's operations."""
    prod = DescriptorProducts(load_kernels())
    desc = SimpleNamespace(axis_neuron=7, nnei=30)
    t, dd, _, _ = _operands(torch.float64, 25, 7)
    if KNOWN_BLAS:
        assert prod.orders(torch.float64, 4, 25, 7) is None
    if prod.orders(torch.float64, 4, 25, 7) is None:
        d, tt = prod.descriptor_of_sum(desc, t * 30)
        assert torch.equal(d, torch_descriptor_of_t(t * 30 / 30, 7)) and torch.equal(
            tt, t * 30 / 30
        )
        assert torch.equal(prod.tbar_of(desc, t, dd.reshape(37, -1)), torch_tbar_of(t, dd, 30))


def test_products_backward_by_finite_differences():
    prod = DescriptorProducts(load_kernels())
    orders = prod.orders(torch.float64, 4, 16, 4)
    if orders is None:
        pytest.skip("this BLAS's summation order is not reproduced")
    t, dd, _, _ = _operands(torch.float64, 16, 4, batch=3)
    t.requires_grad_()
    dd.requires_grad_()
    torch.autograd.gradcheck(lambda a: _Descriptor.apply(prod, orders, 4, 7.0, a), (t,))
    torch.autograd.gradcheck(lambda a, b: _Tbar.apply(prod, orders, 7.0, a, b), (t, dd))


def test_model_with_and_without_the_compiled_products():
    """Energies, forces, virials and every parameter's gradient of a force and virial loss, on
    the kernels backend, with the compiled products and with torch's: the same bits."""
    for setting in ({}, {"type_one_side": False}):
        model = set_random_stats(
            build_model(small_config({"sel": [8, 13], **setting}), backend="kernels")
        )
        coord, atype, box, nlist, shift = batch(model, True, nmol=3)
        pairs = model.form.environment.keywords["pairs"]
        results = []
        for products in (pairs.products, None):
            pairs.products = products
            model.zero_grad(set_to_none=True)
            out = model(coord, atype, box, nlist, shift)
            loss = out["energy"].sum() + (out["force"] ** 2).sum() + (out["virial"] ** 2).sum()
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            results.append([out["energy"], out["force"], out["virial"], *grads])
        pairs.products = results_products = DescriptorProducts(load_kernels())
        if KNOWN_BLAS:  # the compiled products were used
            diff = model.pair_vectors(coord, box, nlist, shift)
            env = model.form.environment(model.descriptor, diff, nlist, atype)
            plan = env.force.plan
            _, cache = model.form.contract(
                model.descriptor, model.embedding, env, plan.nf, plan.natoms
            )
            assert cache.products is results_products
        expected, got = results[1], results[0]
        assert len(expected) == len(got) > 3
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
