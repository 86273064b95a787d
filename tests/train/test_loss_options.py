"""The options of the ``ener`` loss (DeePMD-kit 3.2) against an independent numpy formula.

The reference below is written from DeePMD-kit's definitions (``deepmd/pt/loss/ener.py``,
``deepmd/utils/argcheck.py``), term by term, in numpy; the loss under test is torch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mdtrain.config import complete_config
from mdtrain.train.loss import EnergyLoss, ErrorAccumulator, merge_metrics

NF, NATOMS, NCOORD = 4, 5, 2
START_LR, LR = 1e-3, 2.5e-4
FULL = {
    "start_pref_e": 0.5, "limit_pref_e": 2.0, "start_pref_f": 30.0, "limit_pref_f": 1.0,
    "start_pref_v": 0.2, "limit_pref_v": 0.7,
}  # fmt: skip


def batch(seed: int = 0, nf: int = NF) -> tuple[dict, dict]:
    """Predictions (energy = sum of atomic energies) and every label, float64."""
    rng = np.random.default_rng(seed)
    atom = rng.normal(size=(nf, NATOMS))
    pred = {
        "atom_energy": atom,
        "energy": atom.sum(axis=1),
        "force": rng.normal(size=(nf, NATOMS, 3)),
        "virial": rng.normal(size=(nf, 3, 3)) * 3,
    }
    label = {
        "energy": pred["energy"] + rng.normal(size=nf) * 0.3,
        "force": pred["force"] + rng.normal(size=(nf, NATOMS, 3)) * 0.05,
        "virial": pred["virial"] + rng.normal(size=(nf, 3, 3)),
        "atom_ener": atom + rng.normal(size=(nf, NATOMS)) * 0.02,
        "atom_pref": rng.uniform(0.5, 3.0, size=(nf, NATOMS)),
        "atom_ener_coeff": rng.choice([-1.0, 1.0, 2.0], size=(nf, NATOMS)),
        "drdq": rng.normal(size=(nf, NATOMS, 3 * NCOORD)),
    }
    return pred, label


def to_torch(d: dict) -> dict:
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in d.items()}


def reference(cfg: dict, pred: dict, label: dict, natoms: int, lr: float) -> tuple[float, dict]:
    """DeePMD-kit 3.2's ``ener`` loss and displayed errors (no atom mask: all atoms real)."""

    def pref(x: str) -> float:
        s, lim = cfg.get(f"start_pref_{x}", 0.0), cfg.get(f"limit_pref_{x}", 0.0)
        return lim + (s - lim) * lr / START_LR

    def on(x: str) -> bool:
        return cfg.get(f"start_pref_{x}", 0.0) != 0 and cfg.get(f"limit_pref_{x}", 0.0) != 0

    def hub(r, d):
        r = np.asarray(r)
        return np.mean(np.where(np.abs(r) <= d, 0.5 * r**2, d * (np.abs(r) - 0.5 * d)))

    mae = cfg.get("loss_func", "mse") == "mae"
    huber = cfg.get("use_huber", False) and not mae
    delta = cfg.get("huber_delta", 0.01)
    de, df, dv = delta if isinstance(delta, list) else (delta, delta, delta)
    power = 2 if cfg.get("intensive_ener_virial", False) else 1
    loss, shown = 0.0, {}
    if on("e") and "energy" in label:
        e = pred["energy"]
        if cfg.get("enable_atom_ener_coeff") and "atom_ener_coeff" in label:
            e = np.sum(label["atom_ener_coeff"] * pred["atom_energy"], axis=1)
        diff = label["energy"] - e
        if mae:
            loss += pref("e") * np.mean(np.abs(diff)) / natoms
            shown["mae_e"] = np.mean(np.abs(diff)) / natoms
        else:
            if huber:
                loss += pref("e") * hub(diff / natoms, de)
            else:
                loss += pref("e") * np.mean(diff**2) / natoms**power
            shown["rmse_e"] = math.sqrt(np.mean(diff**2)) / natoms
    dfor = (label["force"] - pred["force"]).reshape(-1, 3)
    if cfg.get("relative_f") is not None:
        dfor = dfor / (
            np.linalg.norm(label["force"].reshape(-1, 3), axis=1)[:, None] + cfg["relative_f"]
        )
    if on("f") and "force" in label:
        norms = np.linalg.norm(dfor, axis=1)
        if mae:
            value = np.mean(norms) if cfg.get("f_use_norm") else np.mean(np.abs(dfor))
            loss += pref("f") * value
            shown["mae_f"] = value
        else:
            if huber:
                loss += pref("f") * hub(norms if cfg.get("f_use_norm") else dfor, df)
            else:
                loss += pref("f") * np.mean(dfor**2)
            shown["rmse_f"] = math.sqrt(np.mean(dfor**2))
    if on("pf") and "force" in label:
        w = label["atom_pref"] if "atom_pref" in label else np.ones(pred["atom_energy"].shape)
        w3 = np.repeat(w.reshape(-1), 3).reshape(-1, 3)  # DeePMD repeats the weight 3 times
        if mae:
            value = np.mean(np.abs(dfor) * w3)
            loss += pref("pf") * value
            shown["mae_pf"] = value
        else:
            value = np.mean(dfor**2 * w3)
            loss += pref("pf") * value
            shown["rmse_pf"] = math.sqrt(value)
    if on("gf") and "force" in label:
        ncoord = cfg["numb_generalized_coord"]
        nf = len(pred["energy"])
        jac = label["drdq"].reshape(nf, natoms * 3, ncoord)
        gl = np.einsum("bij,bi->bj", jac, label["force"].reshape(nf, -1))
        gp = np.einsum("bij,bi->bj", jac, pred["force"].reshape(nf, -1))
        value = np.mean((gl - gp) ** 2)
        loss += pref("gf") * value
        shown["rmse_gf"] = math.sqrt(value)
    if on("v") and "virial" in label:
        diff = (label["virial"] - pred["virial"]).reshape(-1, 9)
        if mae:
            loss += pref("v") * np.mean(np.abs(diff)) / natoms
            shown["mae_v"] = np.mean(np.abs(diff)) / natoms
        else:
            if huber:
                loss += pref("v") * hub(diff / natoms, dv)
            else:
                loss += pref("v") * np.mean(diff**2) / natoms**power
            shown["rmse_v"] = math.sqrt(np.mean(diff**2)) / natoms
    if on("ae") and "atom_ener" in label:
        diff = label["atom_ener"] - pred["atom_energy"]
        if mae:
            loss += pref("ae") * np.mean(np.abs(diff))
            shown["mae_ae"] = np.mean(np.abs(diff))
        else:
            loss += pref("ae") * (hub(diff, de) if huber else np.mean(diff**2))
            shown["rmse_ae"] = math.sqrt(np.mean(diff**2))
    shown["rmse"] = math.sqrt(loss)
    return loss, shown


AE = {"start_pref_ae": 1.5, "limit_pref_ae": 0.5}
PF = {"start_pref_pf": 4.0, "limit_pref_pf": 2.0}
GF = {"start_pref_gf": 3.0, "limit_pref_gf": 1.0, "numb_generalized_coord": NCOORD}
CASES = {
    "default": {},
    "relative_f": {"relative_f": 0.7},
    "relative_f+pf": {"relative_f": 0.3, **PF},
    "ae": AE,
    "pf": PF,
    "pf default weights": {**PF, "use_default_pf": True},
    "gf": GF,
    "atom_ener_coeff": {"enable_atom_ener_coeff": True},
    "huber": {"use_huber": True, "huber_delta": 0.05},
    "huber per term": {"use_huber": True, "huber_delta": [0.02, 0.1, 0.3], **AE},
    "huber f_use_norm": {"use_huber": True, "huber_delta": 0.08, "f_use_norm": True},
    "mae": {"loss_func": "mae"},
    "mae f_use_norm": {"loss_func": "mae", "f_use_norm": True},
    "mae all terms": {"loss_func": "mae", **AE, **PF, **GF},
    "intensive": {"intensive_ener_virial": True},
    "intensive huber": {"intensive_ener_virial": True, "use_huber": True, "huber_delta": 0.5},
}


def make_loss(cfg: dict) -> EnergyLoss:
    config = complete_config({"loss": {**FULL, **cfg}})[0]
    return EnergyLoss.from_config(config["loss"], START_LR)


@pytest.mark.parametrize("name", CASES)
def test_loss_matches_the_reference_formula(name):
    cfg = {**FULL, **CASES[name]}
    pred, label = batch(seed=len(name))
    if name == "pf default weights":
        del label["atom_pref"]
    loss_fn = make_loss(CASES[name])
    got, metrics = loss_fn(to_torch(pred), to_torch(label), NATOMS, LR)
    want, shown = reference(cfg, pred, label, NATOMS, LR)
    assert float(got) == pytest.approx(want, rel=1e-12)
    assert sorted(metrics) == loss_fn.metric_keys() == sorted(shown)
    for key, value in shown.items():
        assert float(metrics[key]) == pytest.approx(value, rel=1e-12), key


def test_options_change_the_loss():
    """Every option is wired: its loss differs from the default one on the same batch."""
    pred, label = map(to_torch, batch(seed=3))
    base = float(make_loss({})(pred, label, NATOMS, LR)[0])
    for name, cfg in CASES.items():
        if name != "default":
            assert float(make_loss(cfg)(pred, label, NATOMS, LR)[0]) != base, name


@pytest.mark.parametrize("name", ["huber per term", "mae all terms", "relative_f+pf", "gf"])
def test_micro_batches_add_up_to_the_full_batch(name):
    pred, label = map(to_torch, batch(seed=5, nf=6))
    loss_fn = make_loss(CASES[name])
    whole, metrics = loss_fn(pred, label, NATOMS, LR)
    parts, total = [], 0.0
    for part in (slice(0, 2), slice(2, 6)):
        weight = (part.stop - part.start) / 6
        sub = lambda d, p=part: {k: v[p] for k, v in d.items()}  # noqa: E731
        value, m = loss_fn(sub(pred), sub(label), NATOMS, LR, weight=weight)
        total += float(value)
        parts.append((m, weight))
    assert total == pytest.approx(float(whole), rel=1e-12)
    merged = merge_metrics(parts)
    for key in metrics:
        assert merged[key] == pytest.approx(float(metrics[key]), rel=1e-12), key


def test_gradients_flow_into_atomic_energies_and_forces():
    pred, label = map(to_torch, batch(seed=8))
    pred = {k: v.clone().requires_grad_(True) for k, v in pred.items()}
    loss, _ = make_loss({**AE, **PF, **GF, "enable_atom_ener_coeff": True})(pred, label, NATOMS, LR)
    loss.backward()
    assert pred["atom_energy"].grad.abs().sum() > 0 and pred["force"].grad.abs().sum() > 0


def test_a_missing_label_shows_nan_and_adds_nothing():
    pred, label = map(to_torch, batch(seed=2))
    loss_fn = make_loss({**AE, **PF})
    del label["atom_ener"], label["atom_pref"]
    loss, metrics = loss_fn(pred, label, NATOMS, LR)
    assert math.isnan(metrics["rmse_ae"]) and math.isnan(metrics["rmse_pf"])
    want, _ = reference(FULL, *(batch(seed=2)), NATOMS, LR)
    assert float(loss) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    "name, keys",
    [
        ("default", ["rmse", "rmse_e", "rmse_f", "rmse_v"]),
        ("mae all terms", ["mae_ae", "mae_e", "mae_f", "mae_pf", "mae_v", "rmse", "rmse_gf"]),
        ("huber per term", ["rmse", "rmse_ae", "rmse_e", "rmse_f", "rmse_v"]),
    ],
)
def test_lcurve_columns_follow_deepmd_names(name, keys):
    assert make_loss(CASES[name]).metric_keys() == keys


def test_validation_accumulates_the_loss_metrics():
    loss_fn = make_loss(CASES["mae all terms"])
    extra = loss_fn.loss_metric_keys()
    assert "mae_f" in extra and "rmse_gf" in extra
    acc = ErrorAccumulator(extra=extra)
    (pa, la), (pb, lb) = batch(seed=1, nf=2), batch(seed=2, nf=3)
    values = []
    for p, lab in ((pa, la), (pb, lb)):
        loss, m = loss_fn(to_torch(p), to_torch(lab), NATOMS, LR)
        acc.add(to_torch(p), to_torch(lab), NATOMS, loss=loss, metrics=m)
        values.append(m)
    got = ErrorAccumulator.from_tensor(acc.to_tensor(), extra).rmse()
    assert got["mae_f"] == pytest.approx((2 * values[0]["mae_f"] + 3 * values[1]["mae_f"]) / 5)
    rms = math.sqrt((2 * values[0]["rmse_gf"] ** 2 + 3 * values[1]["rmse_gf"] ** 2) / 5)
    assert got["rmse_gf"] == pytest.approx(rms)


@pytest.mark.parametrize(
    "loss, message",
    [
        ({"f_use_norm": True}, "loss.f_use_norm: true needs loss.use_huber"),
        ({"use_huber": True, "relative_f": 1.0}, "loss.use_huber: not with loss.relative_f"),
        ({"use_huber": True, **PF}, "loss.use_huber: not with loss.start_pref_pf/limit_pref_pf"),
        ({**GF, "numb_generalized_coord": 0}, "loss.numb_generalized_coord: must be >= 1"),
        ({"start_pref_h": 1.0}, "loss.start_pref_h: must be 0 (the Hessian loss is not"),
        ({"loss_func": "mse2"}, "loss.loss_func: must be one of"),
        ({"huber_delta": [0.1, 0.2]}, "loss.huber_delta"),
    ],
)
def test_conflicting_options_are_one_line(loss, message):
    _, problems = complete_config({"loss": loss})
    found = [p for p in problems if p.startswith("loss")]
    assert len(found) == 1 and found[0].startswith(message), problems
    assert "\n" not in found[0]


@pytest.mark.parametrize("backend", ["fused", "kernels"])
def test_backends_give_the_reference_gradients_of_every_term(backend):
    """The accelerated backends' atomic energies and forces carry the same gradients."""
    from mdtrain.errors import MDTrainError
    from mdtrain.model.backend import build_model
    from mdtrain.neighbors.nlist import build_nlist
    from tests.helpers.models import set_random_stats, small_config, water_like

    box = np.eye(3) * 6.0
    coord, atype = water_like(4, box, seed=0)
    nlist, shift, _ = build_nlist(coord, box, atype, 3.5, [12, 24])
    inputs = (torch.tensor(coord)[None], torch.tensor(atype), torch.tensor(box)[None],
              torch.tensor(nlist)[None], torch.tensor(shift, dtype=torch.float64)[None])  # fmt: skip
    rng = np.random.default_rng(0)
    n = len(atype)
    label = to_torch({
        "energy": [1.0], "force": rng.normal(size=(1, n, 3)), "atom_ener": rng.normal(size=(1, n)),
        "atom_pref": rng.uniform(size=(1, n)), "atom_ener_coeff": rng.choice([1.0, 2.0], (1, n)),
        "drdq": rng.normal(size=(1, n, 3 * NCOORD)),
    })  # fmt: skip
    loss_fn = make_loss({**AE, **PF, **GF, "enable_atom_ener_coeff": True, "relative_f": 0.5})
    grads = []
    reference = set_random_stats(build_model(small_config(), "cpu", backend="reference"), 1)
    try:
        other = build_model(small_config(), "cpu", backend=backend)
    except MDTrainError as exc:
        pytest.skip(str(exc))
    other.load_state_dict(reference.state_dict())
    for model in (reference, other):
        model.train()
        loss, _ = loss_fn(model(*inputs), label, n, LR)
        grads.append(
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])
        )
    assert other.backend == backend
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)
