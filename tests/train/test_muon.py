"""The Muon variants' pieces against independent references: the orthogonalisations keep the
singular vectors and push the singular values to 1; HybridMuon's routing; one AdaMuon step
and one HybridMuon step written out here. (Equality with DeePMD-kit's own optimisers is
checked by tests/interop/test_optimizer_interop.py.)"""

import math

import pytest
import torch

from mdtrain.train.hybrid_muon import (
    HybridMuon,
    gram_orthogonalize,
    quintic_orthogonalize,
    route,
)
from mdtrain.train.muon import AdaMuon, newton_schulz
from mdtrain.train.optimizer import make_adam, step_together


@pytest.mark.parametrize("orth", [newton_schulz, quintic_orthogonalize, gram_orthogonalize])
@pytest.mark.parametrize("shape", [(2, 5, 9), (1, 7, 7), (3, 12, 4)])
def test_orthogonalisation_keeps_singular_vectors(orth, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    if orth is gram_orthogonalize and shape[1] > shape[2]:
        x = x.mT.contiguous()  # the Gram iteration takes wide matrices
    out = orth(x).double()
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    core = u.mT @ out @ vh.mT  # diagonal when out = U f(S) Vᵀ
    diag = torch.diagonal(core, dim1=-2, dim2=-1)
    off = core - torch.diag_embed(diag)
    assert off.abs().max() < 0.05
    assert diag.min() > 0.6 and diag.max() < 1.3


def test_gram_padding_changes_nothing():
    torch.manual_seed(1)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    padded = torch.nn.functional.pad(x, (0, 5))
    torch.testing.assert_close(gram_orthogonalize(padded)[..., :6], gram_orthogonalize(x))
    assert gram_orthogonalize(padded)[..., 6:].abs().max() == 0


@pytest.mark.parametrize(
    "name, shape, mode, expected",
    [
        ("fitting.networks.0.layers.1.weight", (16, 16), "slice", ("muon", (1, 16, 16))),
        ("fitting.networks.0.layers.1.bias", (16,), "slice", ("adam", None)),
        ("a.b", (3, 4), "slice", ("adam", None)),
        ("layer.matrix", (16, 1), "slice", ("adam", None)),  # effectively a vector
        ("layer.Adam_scale", (4, 4), "slice", ("adam", None)),
        ("gains.adamw_scale.0", (4, 4), "slice", ("adamw", None)),
        ("w", (3, 1, 4, 5), "slice", ("muon", (3, 4, 5))),
        ("w", (3, 4, 5), "flat", ("muon", (1, 12, 5))),
        ("w", (3, 4, 5), "2d", ("adamw", None)),
    ],
)
def test_hybrid_routing(name, shape, mode, expected):
    assert route(name, torch.Size(shape), mode) == expected


def test_adamuon_step_written_out():
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    gw, gb = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    w0, b0 = w.detach().clone(), b.detach().clone()
    opt = AdaMuon([w, b], lr=0.1, momentum=0.9, weight_decay=0.01, adam_betas=(0.8, 0.9))
    w.grad, b.grad = gw, gb
    opt.step()
    # matrix: decay, Nesterov momentum from 0, sign, orthogonalise, second moment, scalings
    m = 0.1 * gw
    u = gw + 0.9 * (m - gw)
    o = newton_schulz(torch.sign(u)[None]).float()[0].flatten()
    v = 0.1 * o * o
    o = o / (v.sqrt() + 1e-8)
    o = o / (o.norm() + 1e-8) * (0.2 * math.sqrt(24)) * math.sqrt(6 / 4)
    expected_w = w0 * (1 - 0.1 * 0.01) - 0.1 * o.view(6, 4).double()
    torch.testing.assert_close(w.detach(), expected_w, rtol=1e-6, atol=1e-7)
    # vector: Adam at lr / lr_adjust, bias-corrected first step = sign-like step
    g32 = gb.float()
    step = (
        (0.1 / 10)
        / (1 - 0.8)
        * ((1 - 0.8) * g32)
        / (((1 - 0.9) * g32 * g32 / (1 - 0.9)).sqrt() + 1e-8)
    )
    torch.testing.assert_close(b.detach(), b0 - step.double(), rtol=1e-6, atol=1e-9)


def test_hybrid_step_written_out():
    torch.manual_seed(3)
    named = [("net.weight", torch.nn.Parameter(torch.randn(5, 5, dtype=torch.float64))),
             ("net.bias", torch.nn.Parameter(torch.randn(5, dtype=torch.float64)))]  # fmt: skip
    (_, w), (_, b) = named
    w0 = w.detach().clone()
    g = torch.randn(5, 5, dtype=torch.float64)
    opt = HybridMuon(named, lr=0.05, momentum=0.9, weight_decay=0.1, magma_muon=True)
    w.grad, b.grad = g, torch.randn(5, dtype=torch.float64)
    opt.step()
    m = 0.1 * g
    u = g + 0.9 * (m - g)
    cosine = torch.nn.functional.cosine_similarity(m.flatten(), g.flatten(), dim=0).float()
    low, high = 1 / (1 + math.exp(0.5)), 1 / (1 + math.exp(-0.5))
    raw = ((torch.sigmoid(cosine / 2) - low) / (high - low)).clamp(0, 1)
    damping = 0.1 + 0.9 * (0.9 * 0.5 + 0.1 * raw)
    orth = quintic_orthogonalize(u[None])[0] * (0.18 * math.sqrt(5))
    expected = w0 * (1 - 0.05 * 0.1) - 0.05 * (orth * damping.to(orth.dtype)).double()
    torch.testing.assert_close(w.detach(), expected, rtol=1e-6, atol=1e-6)


def test_step_together_leaves_other_optimisers_alone():
    params = [torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(2)]
    opts = [make_adam([p], 0.1, decoupled=True) for p in params]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    step_together(opts)  # AdamW: each its own step
    reference = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    ref_opt = torch.optim.AdamW([reference], lr=0.1, weight_decay=0.0)
    reference.grad = torch.full_like(reference, 0.5)
    ref_opt.step()
    for p in params:
        torch.testing.assert_close(p.detach(), reference.detach())
