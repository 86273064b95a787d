"""The default ``ener`` loss as one node (``mdtrain.train.loss_mse``) against the same loss
written as operations (``loss_terms``, autograd's nodes): the same loss, metrics and gradient
bit for bit; the node's backward against finite differences."""

from __future__ import annotations

import math

import pytest
import torch

from mdtrain.train.loss import EnergyLoss
from mdtrain.train.loss_mse import _EnergyForceMse, fusable
from mdtrain.train.loss_terms import LossOptions

# the same computation by the operations: an option that changes nothing (no huber) but makes
# the options differ from the defaults, so that the node is not chosen
PLAIN = LossOptions(huber_delta=(0.5, 0.5, 0.5))


def _losses(pref_v: float = 0.0):
    prefs = (0.02, 1.0, 1000.0, 1.0, pref_v, pref_v)
    return EnergyLoss(*prefs, start_lr=1e-3), EnergyLoss(*prefs, start_lr=1e-3, options=PLAIN)


def _case(nf: int, natoms: int, seed: int, virial: bool = False):
    gen = torch.Generator().manual_seed(seed)
    pred = {
        "energy": torch.randn(nf, generator=gen, dtype=torch.float64) * 30,
        "force": torch.randn(nf, natoms, 3, generator=gen, dtype=torch.float64),
        "virial": torch.randn(nf, 3, 3, generator=gen, dtype=torch.float64),
    }
    label = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in pred.items()}
    if not virial:
        del label["virial"]
    return pred, label


def _run(loss_fn, pred, label, natoms, lr, weight):
    leaves = {k: v.clone().requires_grad_(True) for k, v in pred.items()}
    # the gradient reaches the predictions through a node, as from a model
    inputs = {k: v * 1.0 for k, v in leaves.items()}
    loss, metrics = loss_fn(inputs, label, natoms, lr, weight=weight)
    loss.backward()
    return loss.detach(), metrics, {k: v.grad for k, v in leaves.items()}


def _bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b) or (bool(torch.isnan(a).all()) and bool(torch.isnan(b).all()))


@pytest.mark.parametrize("weight", [1.0, 0.375])
@pytest.mark.parametrize("nf", [1, 2, 5])
def test_fused_loss_is_bit_identical_to_the_operations(nf, weight):
    fused, plain = _losses()
    for seed, natoms, lr in ((0, 6, 1e-3), (1, 17, 3.7e-4), (2, 192, 1.234e-5)):
        pred, label = _case(nf, natoms, seed)
        a = _run(fused, pred, label, natoms, lr, weight)
        b = _run(plain, pred, label, natoms, lr, weight)
        assert fused._fused[tuple(label)] and not plain._fused[tuple(label)]
        assert torch.equal(a[0], b[0])
        assert list(a[1]) == list(b[1]) and all(_bits(a[1][k], b[1][k]) for k in a[1])
        assert all(_bits(a[2][k], b[2][k]) for k in ("energy", "force", "virial"))
        assert a[2]["energy"] is not None and a[2]["virial"] is None


def test_a_virial_term_or_an_option_takes_the_operations():
    fused, _ = _losses(pref_v=0.5)
    pred, label = _case(2, 6, 3, virial=True)
    fused(pred, label, 6, 1e-3)
    assert not fused._fused[tuple(label)]
    fused(pred, {k: v for k, v in label.items() if k != "virial"}, 6, 1e-3)
    assert fused._fused[("energy", "force")]  # a system without virials: energy and force
    layout = [("energy", "rmse_e", True), ("force", "rmse_f", True)]
    assert fusable(layout, LossOptions()) and not fusable(layout, LossOptions(loss_func="mae"))
    assert not fusable(layout[:1], LossOptions())


def test_fused_loss_nan_metric_of_a_term_without_labels():
    fused, plain = _losses(pref_v=0.5)
    pred, label = _case(2, 6, 4)  # no virial labels: its metric is NaN
    a, b = _run(fused, pred, label, 6, 1e-3, 1.0), _run(plain, pred, label, 6, 1e-3, 1.0)
    assert math.isnan(float(a[1]["rmse_v"])) and all(_bits(a[1][k], b[1][k]) for k in a[1])
    assert all(_bits(a[2][k], b[2][k]) for k in ("energy", "force"))


def test_fused_loss_gradcheck():
    gen = torch.Generator().manual_seed(6)
    e, f = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((3,), (3, 4, 3)))
    el, fl = torch.randn(3, dtype=torch.float64), torch.randn(3, 4, 3, dtype=torch.float64)
    torch.autograd.gradcheck(
        lambda e, f: _EnergyForceMse.apply(e, f, el, fl, 4, 0.7, 3.0)[0],
        (e.requires_grad_(True), f.requires_grad_(True)),
    )
