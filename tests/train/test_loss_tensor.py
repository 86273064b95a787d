"""The tensor loss against DeePMD-kit's formula written in numpy: atomic and global mean
squared errors with their prefactors, the displayed errors (global divided by N), a missing
label switching its term off (NaN), and micro-batches adding up to the full batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.train.loss_tensor import TensorLoss


def _batch(label: str, k: int, nf: int = 4, natoms: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    atomic = rng.normal(size=(nf, natoms, k))
    pred = {f"atom_{label}": torch.tensor(atomic), label: torch.tensor(atomic.sum(1))}
    labels = {
        f"atomic_{label}": torch.tensor(rng.normal(size=(nf, natoms, k))),
        label: torch.tensor(rng.normal(size=(nf, k))),
    }
    return pred, labels


@pytest.mark.parametrize(
    ("label", "k", "name"), [("dipole", 3, "dipole"), ("polarizability", 9, "polar")]
)
def test_tensor_loss_is_deepmds_formula(label, k, name):
    pred, labels = _batch(label, k)
    loss_fn = TensorLoss.from_config({"pref": 0.7, "pref_atomic": 2.5}, label)
    loss, metrics = loss_fn(pred, labels, natoms=5)
    p = {key: v.numpy() for key, v in pred.items()}
    lab = {key: v.numpy() for key, v in labels.items()}
    local = np.mean((p[f"atom_{label}"] - lab[f"atomic_{label}"]) ** 2)
    glob = np.mean((p[label] - lab[label]) ** 2)
    assert math.isclose(float(loss), 2.5 * local + 0.7 * glob, rel_tol=1e-13)
    assert math.isclose(float(metrics[f"rmse_local_{name}"]), math.sqrt(local), rel_tol=1e-13)
    assert math.isclose(float(metrics[f"rmse_global_{name}"]), math.sqrt(glob) / 5, rel_tol=1e-13)
    assert sorted(metrics) == loss_fn.metric_keys()


def test_missing_label_turns_its_term_off():
    pred, labels = _batch("dipole", 3)
    loss_fn = TensorLoss("dipole", pref=1.0, pref_atomic=1.0)
    only_global = {"dipole": labels["dipole"]}
    loss, metrics = loss_fn(pred, only_global, natoms=5)
    glob = float(((pred["dipole"] - labels["dipole"]) ** 2).mean())
    assert math.isclose(float(loss), glob, rel_tol=1e-13)
    assert math.isnan(float(metrics["rmse_local_dipole"]))
    loss, _ = loss_fn(pred, {}, natoms=5)
    assert float(loss) == 0.0


def test_micro_batches_add_up_to_the_batch():
    pred, labels = _batch("polarizability", 9, nf=6)
    loss_fn = TensorLoss("polarizability", pref=0.3, pref_atomic=1.7)
    full, _ = loss_fn(pred, labels, natoms=5)
    parts = [slice(0, 2), slice(2, 6)]
    total = sum(
        float(
            loss_fn(
                {k: v[s] for k, v in pred.items()},
                {k: v[s] for k, v in labels.items()},
                5,
                weight=(s.stop - s.start) / 6,
            )[0]
        )
        for s in parts
    )
    assert math.isclose(total, float(full), rel_tol=1e-13)


@pytest.mark.parametrize(
    ("loss", "match"),
    [
        ({"pref": 0, "pref_atomic": 0}, "at least one"),
        ({"pref": -1, "pref_atomic": 1}, ">= 0"),
        ({"pref_atomic": 1}, "loss.pref: a number"),
    ],
)
def test_bad_prefactors_are_one_line_errors(loss, match):
    with pytest.raises(MDTrainError, match=match):
        TensorLoss.from_config(loss, "dipole")
