"""The ``dos`` and ``property`` losses against their formulas written out here in numpy
(DeePMD-kit 3.2's ``deepmd/pt/loss/dos.py`` and ``property.py``): every term and metric,
the learning-rate prefactors, a missing label, and micro-batches adding up to the batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.train.loss import merge_metrics
from mdtrain.train.loss_dos import DOSLoss
from mdtrain.train.loss_property import PropertyLoss

NF, N, K = 3, 5, 7


def _dos_batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    pred = {"atom_dos": rng.normal(size=(NF, N, K))}
    pred["dos"] = pred["atom_dos"].sum(axis=1)
    label = {"atom_dos": rng.normal(size=(NF, N, K)), "dos": rng.normal(size=(NF, K)) * 3}
    return pred, label


def _torch(d: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in d.items()}


def test_dos_loss_equals_its_formula():
    prefs = {"dos": (2.0, 0.5), "cdf": (0.3, 0.1), "ados": (1.0, 4.0), "acdf": (0.7, 0.2)}
    loss = DOSLoss(prefs, start_lr=1e-3)
    pred, label = _dos_batch()
    lr = 4e-4
    value, metrics = loss(_torch(pred), _torch(label), N, lr)

    def pref(t):
        start, limit = prefs[t]
        return limit + (start - limit) * lr / 1e-3

    mse = {
        "ados": np.mean((pred["atom_dos"] - label["atom_dos"]) ** 2),
        "acdf": np.mean(
            (np.cumsum(pred["atom_dos"], axis=-1) - np.cumsum(label["atom_dos"], axis=-1)) ** 2
        ),
        "dos": np.mean((pred["dos"] - label["dos"]) ** 2),
        "cdf": np.mean((np.cumsum(pred["dos"], -1) - np.cumsum(label["dos"], -1)) ** 2),
    }
    want = sum(pref(t) * mse[t] for t in mse)
    assert float(value) == pytest.approx(want, rel=1e-12)
    assert float(metrics["rmse_local_dos"]) == pytest.approx(math.sqrt(mse["ados"]), rel=1e-12)
    assert float(metrics["rmse_local_cdf"]) == pytest.approx(math.sqrt(mse["acdf"]), rel=1e-12)
    assert float(metrics["rmse_global_dos"]) == pytest.approx(math.sqrt(mse["dos"]) / N)
    assert float(metrics["rmse_global_cdf"]) == pytest.approx(math.sqrt(mse["cdf"]) / N)
    assert loss.metric_keys() == sorted(
        ["rmse", "rmse_local_dos", "rmse_local_cdf", "rmse_global_dos", "rmse_global_cdf"]
    )


def test_dos_loss_defaults_and_missing_labels():
    loss = DOSLoss.from_config({"type": "dos"}, start_lr=1e-3)  # DeePMD-kit: ados only
    assert loss.terms == ["ados"]
    pred, label = _dos_batch(1)
    value, metrics = loss(_torch(pred), _torch({"dos": label["dos"]}), N, 1e-3)
    assert float(value) == 0.0 and math.isnan(float(metrics["rmse_local_dos"]))
    with pytest.raises(MDTrainError, match="no term of the dos loss"):
        DOSLoss.from_config({"start_pref_ados": 0.0}, start_lr=1e-3)


def test_dos_micro_batches_add_up():
    loss = DOSLoss({"dos": (1, 1), "cdf": (1, 1), "ados": (1, 1), "acdf": (0, 0)}, 1e-3)
    pred, label = _dos_batch(2)
    whole = float(loss(_torch(pred), _torch(label), N, 1e-3)[0])
    parts = 0.0
    for rows, w in ((slice(0, 1), 1 / 3), (slice(1, 3), 2 / 3)):
        p, y = ({k: torch.from_numpy(v[rows]) for k, v in d.items()} for d in (pred, label))
        parts += float(loss(p, y, N, 1e-3, weight=w)[0])
    assert parts == pytest.approx(whole, rel=1e-12)


def _smooth_l1(x: np.ndarray, beta: float) -> np.ndarray:
    ax = np.abs(x)
    return np.where(ax < beta, 0.5 * x**2 / beta, ax - 0.5 * beta)


@pytest.mark.parametrize("intensive", [True, False])
@pytest.mark.parametrize("func", ["smooth_mae", "mae", "mse", "rmse", "mape"])
def test_property_loss_equals_its_formula(func, intensive):
    rng = np.random.default_rng(3)
    p, y = rng.normal(size=(NF, 2)) * 4, rng.normal(size=(NF, 2)) * 4
    bias, std = np.array([0.3, -1.0]), np.array([0.7, 2.5])
    loss = PropertyLoss(
        "gap",
        intensive,
        lambda: (torch.from_numpy(bias), torch.from_numpy(std)),
        func,
        ["smooth_mae", "mae", "mse", "rmse", "mape"],
        beta=0.6,
    )
    value, metrics = loss({"gap": torch.from_numpy(p)}, {"gap": torch.from_numpy(y)}, N)
    pn, yn = (p, y) if intensive else (p / N, y / N)
    a, b = (yn - bias) / std, (pn - bias) / std
    want = {
        "smooth_mae": _smooth_l1(a - b, 0.6).sum(),
        "mae": np.abs(a - b).sum(),
        "mse": ((a - b) ** 2).sum(),
        "rmse": np.sqrt(np.mean((a - b) ** 2)),
        "mape": np.mean(np.abs((yn - pn) / (yn + 1e-3))),
    }[func]
    assert float(value) == pytest.approx(want, rel=1e-12)
    d = yn - pn
    shown = {
        "smooth_mae": _smooth_l1(d, 0.6).mean(),
        "mae": np.abs(d).mean(),
        "mse": (d**2).mean(),
        "rmse": np.sqrt((d**2).mean()),
        "mape": np.mean(np.abs(d / (yn + 1e-3))),
    }
    for name, expected in shown.items():
        assert float(metrics[name]) == pytest.approx(expected, rel=1e-12)


def test_property_sums_over_micro_batches():
    rng = np.random.default_rng(4)
    p, y = rng.normal(size=(NF, 2)), rng.normal(size=(NF, 2))
    stats = lambda: (torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))  # noqa: E731
    loss = PropertyLoss("gap", False, stats)
    whole, shown = loss({"gap": torch.from_numpy(p)}, {"gap": torch.from_numpy(y)}, N)
    split = [
        (loss({"gap": torch.from_numpy(p[r])}, {"gap": torch.from_numpy(y[r])}, N, 0, w), w)
        for r, w in ((slice(0, 2), 2 / 3), (slice(2, 3), 1 / 3))
    ]
    assert sum(float(value) for (value, _), _ in split) == pytest.approx(float(whole), rel=1e-12)
    merged = merge_metrics([(metrics, w) for (_, metrics), w in split])
    assert merged["rmse"] == pytest.approx(float(shown["rmse"]), rel=1e-12)  # root of the sum
    assert loss.metric_keys() == ["mae", "rmse"] and loss.loss_metric_keys() == ["mae"]


@pytest.mark.parametrize("func", ["smooth_mae", "mae", "mse", "rmse", "mape"])
def test_property_loss_on_two_ranks_is_the_global_batch_sum(func):
    """A summed loss on 2 ranks (batch b each) is scaled by 2, so the ranks' averaged
    gradient, (g1 + g2) / 2, is that of one rank's sum over the 2b frames; a mean needs no
    factor; ``rmse``, given the global batch's sums, is the root over the 2b frames, rank 0's
    half split in two micro-batches (weights 1/2) and rank 1's whole."""
    rng = np.random.default_rng(5)
    p = torch.from_numpy(rng.normal(size=(4, 2))).requires_grad_(True)
    y = torch.from_numpy(rng.normal(size=(4, 2)))
    bias, std = torch.tensor([0.2, -0.4], dtype=torch.float64), torch.tensor([1.5, 0.5])
    stats = lambda: (bias, std.double())  # noqa: E731
    one, two = (
        PropertyLoss("gap", True, stats, func),
        PropertyLoss("gap", True, stats, func, ranks=2),
    )
    whole, whole_metrics = one({"gap": p}, {"gap": y}, N)
    (g_one,) = torch.autograd.grad(whole, p)
    parts = [(slice(0, 1), 0.5), (slice(1, 2), 0.5), (slice(2, 4), 1.0)]
    if func == "rmse":  # the sums the trainer's pass gives: every rank the same
        sums = sum(two.batch_sums({"gap": p[r]}, {"gap": y[r]}, N) for r, _ in parts[:2])
        two.set_batch_sums(sums + two.batch_sums({"gap": p[2:]}, {"gap": y[2:]}, N))
        want = torch.stack([((y - p.detach()) / std).square().sum(), torch.tensor(8.0).double()])
        torch.testing.assert_close(two.sums, want, rtol=1e-12, atol=0)
    calls = [two({"gap": p[r]}, {"gap": y[r]}, N, 0.0, w) for r, w in parts]
    halves = [calls[0][0] + calls[1][0], calls[2][0]]
    (g_two,) = torch.autograd.grad(sum(halves) / 2, p)
    torch.testing.assert_close(g_two, g_one, rtol=1e-12, atol=0)
    if func == "rmse":  # the loss shown: the global root, on every rank and micro-batch
        assert float(sum(halves).detach()) == pytest.approx(float(whole.detach()), rel=1e-12)
        for rank in ([0, 1], [2]):
            merged = merge_metrics([(calls[j][1], parts[j][1]) for j in rank])
            assert merged["rmse"] == pytest.approx(float(whole_metrics["rmse"]), rel=1e-12)
        two.set_batch_sums(None)
        (g_roots,) = torch.autograd.grad(
            sum(two({"gap": p[r]}, {"gap": y[r]}, N)[0] for r in (slice(0, 2), slice(2, 4))) / 2,
            p,
        )
        assert not torch.allclose(g_roots, g_one)  # without them: the mean of the roots


def test_property_loss_refuses_unknown_options():
    stats = lambda: (torch.zeros(1), torch.ones(1))  # noqa: E731
    with pytest.raises(MDTrainError, match="loss_func"):
        PropertyLoss("gap", True, stats, "huber")
    with pytest.raises(MDTrainError, match="loss.metric"):
        PropertyLoss("gap", True, stats, metric=["r2"])
