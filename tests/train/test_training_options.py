"""Training with DeePMD-kit 3.2's options: optimisers with exact restarts, the weight average,
full validation with best checkpoints, the bias refit after training, numb_epoch."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.infer.load import load_model
from tests.helpers.training import full_validation_reference, lcurve_rows, make_project


def train(inp, out, *extra: str) -> int:
    return main(["train", str(inp), "-o", str(out), *extra])


def project(root, sections: dict | None = None, **training):
    """The tiny project with extra top-level sections (``optimizer``, ``validating``) and
    learning-rate keys (``sections["learning_rate"]`` is merged)."""
    inp = make_project(root, **training)
    config = json.loads(inp.read_text())
    for name, value in (sections or {}).items():
        if name == "learning_rate":  # merged; a None value removes the key
            config[name].update(value)
            config[name] = {k: v for k, v in config[name].items() if v is not None}
        else:
            config[name] = value
    config["training"] = {k: v for k, v in config["training"].items() if v is not None}
    inp.write_text(json.dumps(config, indent=1))
    return inp


def assert_states_equal(a, b, where=""):
    """Tensors bit for bit, everything else equal, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_states_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_states_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


OPTIMIZERS = [
    {"type": "Adam", "weight_decay": 0.01},
    {"type": "AdamW"},
    {"type": "AdaMuon"},
    {"type": "AdaMuon", "lr_adjust": 0.0},
    {"type": "HybridMuon"},
    {
        "type": "HybridMuon",
        "muon_mode": "2d",
        "enable_gram": False,
        "magma_muon": False,
        "lr_adjust": 5.0,
    },
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "-".join(map(str, o.values())))
def test_restart_is_bit_exact(tmp_path, optimizer):
    """6 steps straight equal 3 steps + restart + 3 steps, bit for bit: weights, optimiser
    state, weight average and lcurve.out (with a warm-up cosine schedule)."""
    sections = {
        "optimizer": optimizer,
        "learning_rate": {"type": "cosine", "warmup_steps": 2, "decay_steps": None},
    }
    inp = project(tmp_path, sections, enable_ema=True, ema_decay=0.9)
    config = json.loads(inp.read_text())
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train(inp, straight) == 0
    os.makedirs(resumed)
    shutil.copy(straight / "model.ckpt-3.pt", resumed / "model.ckpt-3.pt")
    rows = [ln for ln in (straight / "lcurve.out").read_text().splitlines(True)]
    (resumed / "lcurve.out").write_text(
        "".join(r for r in rows if r.startswith("#") or int(r.split()[0]) <= 3)
    )
    assert train(inp, resumed, "--restart", str(resumed / "model.ckpt-3.pt")) == 0
    a = torch.load(straight / "model.ckpt-6.pt", weights_only=True)
    b = torch.load(resumed / "model.ckpt-6.pt", weights_only=True)
    for key in ("model_state", "optimizer_state", "ema", "step"):
        assert_states_equal(a[key], b[key], key)
    assert (straight / "lcurve.out").read_text() == (resumed / "lcurve.out").read_text()
    ema_a = torch.load(straight / "model_ema.ckpt-6.pt", weights_only=True)["model_state"]
    ema_b = torch.load(resumed / "model_ema.ckpt-6.pt", weights_only=True)["model_state"]
    assert_states_equal(ema_a, ema_b)
    # the optimiser did something different from plain Adam
    assert a["optimizer_state"]["param_groups"][0].get("weight_decay") == config["optimizer"].get(
        "weight_decay",
        {"AdamW": 0.001, "AdaMuon": 0.001, "HybridMuon": 0.001}.get(optimizer["type"]),
    )


def test_weight_average_checkpoints(tmp_path):
    """The averaged weights go to model_ema.ckpt-<step>.pt (no optimiser state, `checkpoint`
    left to the regular family); with decay 0 the average is the live weights exactly."""
    inp = project(tmp_path, enable_ema=True, ema_decay=0.0)
    out = tmp_path / "out"
    assert train(inp, out) == 0
    assert (out / "checkpoint").read_text().strip() == "model.ckpt-6.pt"
    assert os.path.realpath(out / "model_ema.ckpt.pt") == str(out / "model_ema.ckpt-6.pt")
    live = torch.load(out / "model.ckpt-6.pt", weights_only=True)
    averaged = torch.load(out / "model_ema.ckpt-6.pt", weights_only=True)
    assert "optimizer_state" not in averaged and averaged["averaged_weights"] is True
    assert_states_equal(live["model_state"], averaged["model_state"])
    assert (
        main(["test", "-m", str(out / "model_ema.ckpt.pt"), "-s", str(tmp_path / "data" / "valid")])
        == 0
    )
    # --restart from an averaged checkpoint is refused in one line
    assert train(inp, out, "--restart", str(out / "model_ema.ckpt-6.pt")) == 1


def test_average_follows_the_formula(tmp_path):
    """ema_k = d * ema_{k-1} + (1 - d) * w_k over the saved steps, checked with save_freq 1."""
    from mdtrain.train.ema import WeightAverage

    model = torch.nn.Linear(3, 2).double()
    avg = WeightAverage(model, 0.75)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for k in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.full_like(p, 0.1 * (k + 1)))
        avg.update(model)
        for n, p in model.named_parameters():
            expected[n] = 0.75 * expected[n] + 0.25 * p.detach()
    for n, t in avg.state_dict()["model"].items():
        torch.testing.assert_close(t, expected[n], rtol=1e-14, atol=0)
    own = {n: p.detach().clone() for n, p in model.named_parameters()}
    with avg.applied(model):
        assert all(torch.equal(p, avg.shadow[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p, own[n]) for n, p in model.named_parameters())


def test_full_validation_and_best_checkpoints(tmp_path):
    validating = {
        "full_validation": True, "validation_freq": 2, "full_val_start": 0,
        "max_best_ckpt": 2, "validation_metric": "f:rmse",
    }  # fmt: skip
    inp = project(tmp_path, {"validating": validating}, save_freq=2)
    out = tmp_path / "out"
    assert train(inp, out) == 0
    text = (out / "val.log").read_text().splitlines()
    header = text[0].split()
    assert header[:2] == ["#", "step"]
    assert header[2:] == [
        "E_MAE(meV/atom)", "E_RMSE(meV/atom)", "F_MAE(meV/Å)", "F_RMSE(meV/Å)",
        "S_MAE(meV/Å³)", "S_RMSE(meV/Å³)",
    ]  # fmt: skip
    rows = {
        int(r.split()[0]): [float(x) for x in r.split()[1:]] for r in text if not r.startswith("#")
    }
    assert sorted(rows) == [2, 4, 6]
    for step, values in rows.items():
        ref = full_validation_reference(out / f"model.ckpt-{step}.pt", tmp_path / "data" / "valid")
        got = dict(zip(header[2:], values, strict=True))
        for key, value in ref.items():
            unit_key = next(h for h in got if h.startswith(key + "("))
            assert got[unit_key] == pytest.approx(value, rel=2e-4), (step, key)
    f_rmse = {s: v[3] for s, v in rows.items()}
    best = sorted(f_rmse, key=lambda s: (f_rmse[s], s))[:2]
    names = sorted(p for p in os.listdir(out) if p.startswith("best.ckpt-"))
    assert names == sorted(f"best.ckpt-{s}.t-{k}.pt" for k, s in enumerate(best, start=1))
    for k, s in enumerate(best, start=1):
        saved = torch.load(out / f"best.ckpt-{s}.t-{k}.pt", weights_only=True)
        regular = torch.load(out / f"model.ckpt-{s}.pt", weights_only=True)
        assert_states_equal(saved["model_state"], regular["model_state"])
    last = torch.load(out / "model.ckpt-6.pt", weights_only=True)
    assert [s for _, s in last["full_validation"]["live"]["records"]] == best


def stat_residual_normal_equations(checkpoint, config, root):
    """Nᵀ(E − Ê) on the frames sampled for the statistics: zero when the bias is the
    least-squares fit to them (relative to Nᵀ E)."""
    from mdtrain.model.stats import collect_stat_batches
    from mdtrain.train.bias import predicted_energies

    model = load_model(checkpoint)
    systems = [open_system(str(root / "data" / s), ["O", "H"]) for s in ("train_a", "train_b")]
    batches = collect_stat_batches(
        systems, model.get_model_config(), config["model"]["data_stat_nbatch"]
    )
    counts = np.concatenate([np.tile(b["natoms_per_type"], (len(b["energy"]), 1)) for b in batches])
    energy = np.concatenate([b["energy"] for b in batches])
    residual = energy - predicted_energies(model, batches)
    return counts.T @ residual / np.abs(counts.T @ energy)


def test_change_bias_after_training(tmp_path):
    plain = project(tmp_path / "plain")
    refit = project(tmp_path / "refit", change_bias_after_training=True)
    assert train(plain, tmp_path / "plain" / "out") == 0
    assert train(refit, tmp_path / "refit" / "out") == 0
    a = torch.load(tmp_path / "plain" / "out" / "model.ckpt-6.pt", weights_only=True)
    b = torch.load(tmp_path / "refit" / "out" / "model.ckpt-6.pt", weights_only=True)
    assert not torch.equal(a["model_state"]["out_bias"], b["model_state"]["out_bias"])
    same = {k for k in a["model_state"] if k != "out_bias"}
    assert all(torch.equal(a["model_state"][k], b["model_state"][k]) for k in same)
    config = json.loads(refit.read_text())
    before = stat_residual_normal_equations(
        tmp_path / "plain" / "out" / "model.ckpt-6.pt", config, tmp_path / "plain"
    )
    after = stat_residual_normal_equations(
        tmp_path / "refit" / "out" / "model.ckpt-6.pt", config, tmp_path / "refit"
    )
    assert np.abs(before).max() > 1e-6
    assert np.abs(after).max() < 1e-10


def test_numb_epoch_sets_the_length(tmp_path):
    # two systems of 8 frames, batch 2: 4 batches each, drawn with p = 1/2: 8 steps an epoch
    inp = project(tmp_path, numb_epoch=1.5, numb_steps=None)
    out = tmp_path / "out"
    assert train(inp, out) == 0
    assert lcurve_rows(out / "lcurve.out")[-1, 0] == 12
    assert (out / "checkpoint").read_text().strip() == "model.ckpt-12.pt"


def test_committee_members_keep_their_own_average_and_validation(tmp_path):
    validating = {"full_validation": True, "validation_freq": 3, "full_val_start": 0}
    inp = project(tmp_path, {"validating": validating}, enable_ema=True, ema_decay=0.0)
    out = tmp_path / "out"
    assert train(inp, out, "--ensemble", "2") == 0
    weights = []
    for k in range(2):
        member = out / f"member-{k}"
        live = torch.load(member / "model.ckpt-6.pt", weights_only=True)["model_state"]
        averaged = torch.load(member / "model_ema.ckpt-6.pt", weights_only=True)["model_state"]
        assert_states_equal(live, averaged)  # decay 0: the average follows every step
        rows = [r for r in (member / "val.log").read_text().splitlines() if not r.startswith("#")]
        assert [int(r.split()[0]) for r in rows] == [3, 6]
        weights.append(live)
    assert not torch.equal(*(w["fitting.networks.0.layers.0.weight"] for w in weights))
