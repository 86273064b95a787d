"""float16 products (``mixed_precision`` ``"fp16"``, DeePMD-kit's ``compute_prec: "float16"``),
their dynamic loss scaling, and DeePMD-kit's ``output_prec`` (the networks' precision)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.config import complete_config
from mdtrain.model.autocast import compute_mode
from mdtrain.model.backend import build_model
from mdtrain.train.loss_scale import LossScaler
from mdtrain.train.precision import mixed_precision
from tests.helpers.matmuls import MatmulDtypes
from tests.helpers.models import batch, set_random_stats, small_config
from tests.helpers.training import lcurve_rows, make_project, tiny_config

F32 = {"precision": "float32"}
CPU = torch.device("cpu")


def _forward(model, args) -> tuple[dict, list]:
    model.zero_grad()
    out = model(*args)
    loss = out["energy"].sum() + (out["force"] ** 2).sum()
    loss.backward()
    return {k: v.detach() for k, v in out.items()}, [p.grad.clone() for p in model.parameters()]


def _model(parts: dict, mode: str | None):
    return set_random_stats(build_model(small_config(parts, parts), mixed_precision=mode)).train()


@pytest.mark.parametrize("parts", [F32, {}], ids=["float32", "float64"])
def test_fp16_products_agree_with_the_networks_precision_at_the_fp16_level(parts):
    """float32 networks ("fp16") and DeePMD-kit's output_prec float64 (float64 parameters):
    the hidden layers' products in float16, everything else in the networks' precision."""
    ref_model = _model(parts, None)
    args = batch(ref_model, nmol=4)
    ref, ref_grads = _forward(ref_model, args)
    model = _model(parts, "fp16")
    assert model.backend == "reference" and compute_mode(model) == "fp16"
    dtype = ref_model.fitting.networks[0].layers[0].weight.dtype
    with mixed_precision("fp16", model, CPU), MatmulDtypes() as seen:
        out, grads = _forward(model, args)
    assert seen.seen[("addmm", "torch.float16")] > 0 and seen.seen[("mm", "torch.float16")] > 0
    for key in ("energy", "force", "virial"):
        err = float((out[key] - ref[key]).norm() / ref[key].norm())
        # float16 keeps 11 bits (rounding 2^-12 ≈ 2.4e-4): well above float32's noise
        assert 1e-6 < err < 1e-2, (key, err)
    for g, g_ref in zip(grads, ref_grads):
        assert g.dtype == dtype and torch.isfinite(g).all()
        if g_ref.norm() > 0:
            assert float((g - g_ref).norm() / g_ref.norm()) < 2e-2
    assert all(p.dtype == dtype for p in model.parameters())


def test_deepmd_form_sets_the_networks_precision():
    config, problems = complete_config(tiny_config(mixed_precision={"compute_prec": "float16"}))
    assert problems == []
    assert config["training"]["mixed_precision"] == {
        "compute_prec": "float16", "output_prec": "float32"
    }  # fmt: skip
    assert config["model"]["descriptor"]["precision"] == "float32"
    assert config["model"]["fitting_net"]["precision"] == "float32"
    value = {"output_prec": "float64", "compute_prec": "bfloat16"}
    config, problems = complete_config(tiny_config(mixed_precision=value))
    assert problems == [] and config["model"]["fitting_net"]["precision"] == "float64"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"mixed_precision": {"output_prec": "float64", "compute_prec": "float16"},
             "descriptor_precision": "float32"},
            'model.descriptor.precision: "float32" conflicts with '
            'training.mixed_precision.output_prec "float64"',
        ),
        ({"zero_stage": 2}, "training.zero_stage: must be 0 or 1 (stages 2 and 3"),
        ({"zero_stage": 3}, "training.zero_stage: must be 0 or 1 (stages 2 and 3"),
        (
            {"mixed_precision": "fp16", "ensemble": 2},
            'training.mixed_precision "fp16" (its loss scaling) trains one model, not a '
            "committee",
        ),
    ],
)  # fmt: skip
def test_refused_combinations_are_one_line(change, message):
    change = dict(change)
    precision = change.pop("descriptor_precision", None)
    config = tiny_config(**change)
    if precision:
        config["model"]["descriptor"]["precision"] = precision
    _, problems = complete_config(config)
    assert len(problems) == 1 and problems[0].startswith(message), problems


def _grads(values: list[float]) -> list[torch.Tensor]:
    params = [torch.zeros(2, requires_grad=True) for _ in values]
    for p, v in zip(params, values):
        p.grad = torch.full((2,), v)
    return params


def test_loss_scaler_unscales_exactly_skips_on_overflow_and_grows():
    scaler = LossScaler(scale=2.0**10, interval=2)
    params = _grads([3.0 * 2**10, -0.1 * 2**10])
    assert scaler.unscale(params, bool)
    tenth = torch.tensor(-0.1).item()  # float32's -0.1: the scale divides out exactly
    assert params[0].grad.tolist() == [3.0, 3.0] and params[1].grad.tolist() == [tenth] * 2
    assert scaler.scale == 2**10 and scaler.good_steps == 1
    assert scaler.unscale(_grads([1.0]), bool) and scaler.scale == 2**11  # 2 good steps
    assert not scaler.unscale(_grads([1.0, float("inf")]), bool)
    assert not scaler.unscale(_grads([float("nan")]), bool)
    assert scaler.scale == 2**9 and scaler.good_steps == 0 and scaler.skipped == 2
    # another rank overflowed: this one skips too
    assert not scaler.unscale(_grads([1.0]), lambda bad: True) and scaler.scale == 2**8
    again = LossScaler()
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == scaler.state_dict()
    assert scaler.scaled(torch.tensor(1.5)).item() == 1.5 * 2**8


def _project(root, **training):
    inp = make_project(root, **training)
    config = json.loads(inp.read_text())
    for part in ("descriptor", "fitting_net"):
        config["model"][part]["precision"] = "float32"
    inp.write_text(json.dumps(config))
    return inp


def test_fp16_trains_skips_overflowing_steps_and_restarts_exactly(tmp_path, capsys):
    """torch's first scale (2^16) is too large for these gradients: the first steps overflow
    and are skipped, the scale halves until the gradients fit, the loss goes down and the
    forces stay finite; a restart from step 6 continues the scale and ends on the same
    weights."""
    inp = _project(tmp_path, mixed_precision="fp16", disp_freq=1, numb_steps=12, save_freq=6)
    assert main(["train", str(inp), "-o", str(tmp_path / "a")]) == 0
    assert "float16 gradients overflowed: step skipped" in capsys.readouterr().err
    rows = lcurve_rows(tmp_path / "a" / "lcurve.out")
    assert np.isfinite(rows[:, 1:]).all()  # forces (rmse_f) finite throughout
    assert rows[-1, 2] < rows[0, 2]
    first = torch.load(tmp_path / "a" / "model.ckpt-6.pt", weights_only=True)
    state = torch.load(tmp_path / "a" / "model.ckpt-12.pt", weights_only=True)
    skipped = state["loss_scale"]["skipped"]
    assert 0 < skipped < 12 and state["loss_scale"]["scale"] == 2.0 ** (16 - skipped)
    weights = [k for k, v in state["model_state"].items() if k.endswith("weight")]
    assert all(state["model_state"][k].dtype == torch.float32 for k in weights)
    assert any(not torch.equal(state["model_state"][k], first["model_state"][k]) for k in weights)
    assert main(
        ["train", str(inp), "-o", str(tmp_path / "b"), "--restart",
         str(tmp_path / "a" / "model.ckpt-6.pt")]
    ) == 0  # fmt: skip
    again = torch.load(tmp_path / "b" / "model.ckpt-12.pt", weights_only=True)
    assert again["loss_scale"] == state["loss_scale"]
    for key, value in state["model_state"].items():
        assert torch.equal(again["model_state"][key], value), key
