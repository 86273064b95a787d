"""Energy loss and error accumulators against direct numpy computation."""

import math

import numpy as np
import pytest
import torch

from mdtrain.train.loss import EnergyLoss, ErrorAccumulator, merge_metrics, one_sided_terms

NF, N = 6, 5


def make_batch(seed=0, nf=NF, natoms=N, labels=("energy", "force", "virial")):
    g = torch.Generator().manual_seed(seed)
    full_pred = {
        "energy": torch.randn(nf, generator=g, dtype=torch.float64),
        "force": torch.randn(nf, natoms, 3, generator=g, dtype=torch.float64),
        "virial": torch.randn(nf, 3, 3, generator=g, dtype=torch.float64),
    }
    full_label = {
        k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in full_pred.items()
    }
    return full_pred, {k: v for k, v in full_label.items() if k in labels}


def numpy_loss(pred, label, natoms, prefs):
    """Reference: the formulas of the spec written out with numpy."""
    p = {k: v.detach().numpy() for k, v in pred.items()}
    lab = {k: v.numpy() for k, v in label.items()}
    total = 0.0
    if "energy" in prefs:
        total += prefs["energy"] * np.mean((p["energy"] - lab["energy"]) ** 2 / natoms)
    if "force" in prefs:
        total += prefs["force"] * np.mean((p["force"] - lab["force"]) ** 2)
    if "virial" in prefs:
        dv = (p["virial"] - lab["virial"]).reshape(len(p["virial"]), 9)
        total += prefs["virial"] * np.mean(np.mean(dv**2, axis=1) / natoms)
    return total


def test_loss_and_metrics_match_numpy():
    loss_fn = EnergyLoss(0.02, 1.0, 1000.0, 1.0, 0.5, 2.0, start_lr=1e-3)
    pred, label = make_batch()
    lr = 2.5e-4
    coef = lr / 1e-3
    prefs = {
        "energy": 1.0 + (0.02 - 1.0) * coef,
        "force": 1.0 + (1000.0 - 1.0) * coef,
        "virial": 2.0 + (0.5 - 2.0) * coef,
    }
    loss, metrics = loss_fn(pred, label, N, lr)
    ref = numpy_loss(pred, label, N, prefs)
    assert loss.item() == pytest.approx(ref, rel=1e-12)
    de = (pred["energy"] - label["energy"]).numpy()
    df = (pred["force"] - label["force"]).numpy()
    dv = (pred["virial"] - label["virial"]).numpy().reshape(NF, 9)
    assert metrics["rmse"].item() == pytest.approx(math.sqrt(ref), rel=1e-12)
    assert metrics["rmse_e"].item() == pytest.approx(np.sqrt(np.mean(de**2 / N**2)), rel=1e-12)
    assert metrics["rmse_f"].item() == pytest.approx(np.sqrt(np.mean(df**2)), rel=1e-12)
    assert metrics["rmse_v"].item() == pytest.approx(
        np.sqrt(np.mean(np.mean(dv**2, axis=1) / N**2)), rel=1e-12
    )
    assert sorted(metrics) == loss_fn.metric_keys() == ["rmse", "rmse_e", "rmse_f", "rmse_v"]


def test_prefactors_at_start_and_end():
    loss_fn = EnergyLoss(0.02, 1.0, 1000.0, 1.0, 0.0, 0.0, start_lr=1e-3)
    assert loss_fn.pref("force", 1e-3) == pytest.approx(1000.0)
    assert loss_fn.pref("force", 0.0) == pytest.approx(1.0)
    assert loss_fn.pref("energy", 1e-3) == pytest.approx(0.02)


def test_active_term_rule_is_both_prefactors_and_label_present():
    # DeePMD-kit's PyTorch backend: a term counts only when start AND limit are non-zero, so
    # start_pref_v = 0, limit_pref_v = 1 trains no virial (its TensorFlow backend would)
    loss_fn = EnergyLoss(0.0, 0.0, 1.0, 1.0, 0.0, 1.0, start_lr=1e-3)
    assert loss_fn.configured_terms() == ["force"]
    assert loss_fn.active_terms(["energy", "force", "virial"]) == ["force"]
    assert loss_fn.metric_keys() == ["rmse", "rmse_f"]
    pred, label = make_batch()
    lr = 1e-4
    loss, metrics = loss_fn(pred, label, N, lr)
    assert loss.item() == pytest.approx(numpy_loss(pred, label, N, {"force": 1.0}), rel=1e-12)
    assert sorted(metrics) == ["rmse", "rmse_f"]  # no virial or energy metric either
    # the other one-sided form, start non-zero and limit zero, is off as well
    one_sided = EnergyLoss(0.02, 0.0, 1.0, 1.0, 0.0, 0.0, start_lr=1e-3)
    assert one_sided.configured_terms() == ["force"]
    # both non-zero: the term counts, and drops out (metric nan) for a system without labels
    both = EnergyLoss(0.0, 0.0, 1.0, 1.0, 0.5, 1.0, start_lr=1e-3)
    assert both.configured_terms() == ["force", "virial"]
    _, label_nov = make_batch(labels=("energy", "force"))
    loss2, metrics2 = both(pred, label_nov, N, lr)
    assert loss2.item() == pytest.approx(numpy_loss(pred, label_nov, N, {"force": 1.0}), rel=1e-12)
    assert math.isnan(metrics2["rmse_v"].item())
    assert not math.isnan(metrics2["rmse_f"].item())


def test_one_sided_terms_are_named_for_a_warning():
    loss = {"start_pref_e": 0.02, "limit_pref_e": 0.0, "start_pref_f": 1000, "limit_pref_f": 1}
    loss |= {"start_pref_v": 0.0, "limit_pref_v": 1.0}
    messages = one_sided_terms(loss)
    assert len(messages) == 2
    assert "energy term is off" in messages[0] and "virial term is off" in messages[1]
    assert one_sided_terms({"start_pref_f": 1, "limit_pref_f": 1}) == []


def test_no_active_term_gives_zero_loss_that_backpropagates():
    loss_fn = EnergyLoss(0.0, 0.0, 0.0, 0.0, 1.0, 1.0, start_lr=1e-3)
    pred, label = make_batch(labels=("energy", "force"))
    pred["energy"].requires_grad_(True)
    loss, metrics = loss_fn(pred, label, N, 1e-3)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(pred["energy"].grad, torch.zeros(NF, dtype=torch.float64))
    assert math.isnan(metrics["rmse_v"].item())


def test_micro_batches_sum_to_full_batch_loss_gradient_and_metrics():
    loss_fn = EnergyLoss(0.02, 1.0, 1000.0, 1.0, 0.3, 1.0, start_lr=1e-3)
    pred, label = make_batch(seed=3)
    lr = 3e-4

    def grads(split):
        leaves = {k: v.clone().requires_grad_(True) for k, v in pred.items()}
        total, parts = 0.0, []
        start = 0
        for size in split:
            sl = slice(start, start + size)
            w = size / NF
            loss, metrics = loss_fn(
                {k: v[sl] for k, v in leaves.items()},
                {k: v[sl] for k, v in label.items()},
                N,
                lr,
                weight=w,
            )
            loss.backward()
            total += loss.item()
            parts.append((metrics, w))
            start += size
        return total, {k: v.grad for k, v in leaves.items()}, merge_metrics(parts)

    full_loss, full_grad, full_metrics = grads([NF])
    micro_loss, micro_grad, micro_metrics = grads([1, 2, 3])
    assert micro_loss == pytest.approx(full_loss, rel=1e-13)
    for k in full_grad:
        torch.testing.assert_close(micro_grad[k], full_grad[k], rtol=1e-13, atol=0)
    for k in full_metrics:
        assert micro_metrics[k] == pytest.approx(full_metrics[k], rel=1e-12)


def test_merge_metrics_keeps_nan():
    parts = [({"rmse": 1.0, "rmse_v": math.nan}, 0.5), ({"rmse": 2.0, "rmse_v": math.nan}, 0.5)]
    merged = merge_metrics(parts)
    assert merged["rmse"] == pytest.approx(math.sqrt(0.5 + 2.0))
    assert math.isnan(merged["rmse_v"])


def test_from_config():
    cfg = {
        "start_pref_e": 0.02,
        "limit_pref_e": 1,
        "start_pref_f": 1000,
        "limit_pref_f": 1,
        "start_pref_v": 0,
        "limit_pref_v": 0,
    }
    loss_fn = EnergyLoss.from_config(cfg, start_lr=1e-3)
    assert loss_fn.prefs == {
        "energy": (0.02, 1.0),
        "force": (1000.0, 1.0),
        "virial": (0.0, 0.0),
        **{term: (0.0, 0.0) for term in ("atom_ener", "atom_pref", "drdq")},
    }


def test_error_accumulator_matches_brute_force_over_systems():
    # two systems with different sizes, one without virial labels
    pa, la = make_batch(seed=1, nf=4, natoms=3)
    pb, lb = make_batch(seed=2, nf=3, natoms=7, labels=("energy", "force"))
    acc = ErrorAccumulator()
    acc.add({k: v[:2] for k, v in pa.items()}, {k: v[:2] for k, v in la.items()}, 3, loss=0.5)
    acc.add({k: v[2:] for k, v in pa.items()}, {k: v[2:] for k, v in la.items()}, 3, loss=1.5)
    acc.add(pb, lb, 7, loss=torch.tensor(2.0))
    de = np.concatenate(
        [(pa["energy"] - la["energy"]).numpy() / 3, (pb["energy"] - lb["energy"]).numpy() / 7]
    )
    df = np.concatenate(
        [(pa["force"] - la["force"]).numpy().ravel(), (pb["force"] - lb["force"]).numpy().ravel()]
    )
    dv = (pa["virial"] - la["virial"]).numpy().ravel() / 3
    rmse, mae = acc.rmse(), acc.mae()
    assert rmse["rmse_e"] == pytest.approx(np.sqrt(np.mean(de**2)), rel=1e-12)
    assert rmse["rmse_f"] == pytest.approx(np.sqrt(np.mean(df**2)), rel=1e-12)
    assert rmse["rmse_v"] == pytest.approx(np.sqrt(np.mean(dv**2)), rel=1e-12)
    assert rmse["rmse"] == pytest.approx(np.sqrt((0.5 * 2 + 1.5 * 2 + 2.0 * 3) / 7), rel=1e-12)
    assert mae["mae_e"] == pytest.approx(np.mean(np.abs(de)), rel=1e-12)
    assert mae["mae_f"] == pytest.approx(np.mean(np.abs(df)), rel=1e-12)
    assert mae["mae_v"] == pytest.approx(np.mean(np.abs(dv)), rel=1e-12)
    assert acc.count("e") == 7 and acc.count("f") == df.size and acc.count("v") == 36

    # split across two "ranks", reduced through tensors: identical result
    r0, r1 = ErrorAccumulator(), ErrorAccumulator()
    r0.add({k: v[:2] for k, v in pa.items()}, {k: v[:2] for k, v in la.items()}, 3, loss=0.5)
    r1.add({k: v[2:] for k, v in pa.items()}, {k: v[2:] for k, v in la.items()}, 3, loss=1.5)
    r1.add(pb, lb, 7, loss=2.0)
    reduced = ErrorAccumulator.from_tensor(r0.to_tensor() + r1.to_tensor())
    assert reduced.rmse() == pytest.approx(rmse, rel=1e-14)
    r0.merge(r1)
    assert r0.mae() == pytest.approx(mae, rel=1e-14)


def test_error_accumulator_empty_is_nan():
    acc = ErrorAccumulator()
    pred, label = make_batch(labels=("force",))
    acc.add(pred, label, N)
    rmse = acc.rmse()
    assert math.isnan(rmse["rmse_e"]) and math.isnan(rmse["rmse_v"]) and math.isnan(rmse["rmse"])
    assert not math.isnan(rmse["rmse_f"])
    assert math.isnan(acc.mae()["mae_e"])
