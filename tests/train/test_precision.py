"""Mixed precision (``training.mixed_precision``): bf16 autocast in the networks only, tf32 as
a switch for the run, the configuration forms and their errors, and checkpoints that stay
float32 models. CPU autocast stands in for a GPU's."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.config import complete_config
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from mdtrain.model.autocast import compute_mode
from mdtrain.model.backend import build_model
from mdtrain.train.precision import check_networks, mixed_precision, mode_of
from tests.helpers.matmuls import MatmulDtypes
from tests.helpers.models import batch, set_random_stats, small_config
from tests.helpers.training import lcurve_rows, make_project, tiny_config

CPU = torch.device("cpu")
F32 = {"precision": "float32"}


def float32_model(mode: str | None = None):
    model = set_random_stats(build_model(small_config(F32, F32), mixed_precision=mode))
    model.train()
    return model


def outputs_and_grads(model, args) -> tuple[dict, list]:
    """Outputs and parameter gradients of a loss on energies, forces and virials."""
    model.zero_grad()
    out = model(*args)
    loss = out["energy"].sum() + (out["force"] ** 2).sum() + (out["virial"] ** 2).sum()
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return {k: v.detach().clone() for k, v in out.items()}, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_bf16_agrees_with_float32_at_the_bf16_level():
    model = float32_model()
    args = batch(model, nmol=4)
    ref, ref_grads = outputs_and_grads(model, args)
    bf16 = float32_model("bf16")
    assert bf16.backend == "reference" and compute_mode(bf16) == "bf16"
    with mixed_precision("bf16", bf16, CPU):
        out, grads = outputs_and_grads(bf16, args)
    for key in ("energy", "atom_energy", "force", "virial"):
        assert out[key].dtype == torch.float64
        err = rel_err(out[key], ref[key])
        # bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 2e-3); float32 noise
        # is ~1e-7: an error in between shows the products really ran in bfloat16
        assert 1e-5 < err < 3e-2, (key, err)
    for g, g_ref in zip(grads, ref_grads):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        if g_ref.norm() > 0:
            assert rel_err(g, g_ref) < 5e-2


def test_bf16_rounds_only_the_network_products():
    """Embedding and fitting products in bfloat16; the descriptor contraction (bmm) and the
    pair geometry stay float32/float64, and every net hands back float32."""
    model = float32_model("bf16")
    args = batch(model)
    with mixed_precision("bf16", model, CPU), MatmulDtypes() as seen:
        value = model.descriptor.networks[0](torch.rand(5, 1, dtype=torch.float32))
        model(*args)
    assert value.dtype == torch.float32
    kinds = seen.seen
    assert kinds[("addmm", "torch.bfloat16")] > 0 and kinds[("mm", "torch.bfloat16")] > 0
    contractions = {k: n for k, n in kinds.items() if k[0] in ("bmm", "baddbmm")}
    assert contractions and all(k[1] in ("torch.float32", "torch.float64") for k in contractions)


def test_bf16_model_keeps_the_state_dict_and_needs_building_for_it():
    model = float32_model("bf16")
    plain = float32_model()
    assert list(model.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(model.state_dict())
    with pytest.raises(MDTrainError, match="not built for it"), mixed_precision("bf16", plain, CPU):
        pass


def test_tf32_is_set_for_the_block_on_cuda_and_warns_on_cpu(caplog):
    model = float32_model()
    assert torch.get_float32_matmul_precision() == "highest"
    with mixed_precision("tf32", model, torch.device("cuda")):  # only a global switch
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == "highest"
    with caplog.at_level(logging.WARNING, logger="mdtrain"), mixed_precision("tf32", model, CPU):
        assert torch.get_float32_matmul_precision() == "highest"
    warnings = [r for r in caplog.records if "tf32" in r.getMessage()]
    assert len(warnings) == 1 and "no effect on cpu" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        (None, None),
        ("tf32", "tf32"),
        ("bf16", "bf16"),
        ("bfloat16", "bf16"),
        ({"output_prec": "float32", "compute_prec": "bfloat16"}, "bf16"),
        ({"compute_prec": "bfloat16"}, "bf16"),
        ("fp16", "fp16"),
        ("float16", "fp16"),
        ({"output_prec": "float64", "compute_prec": "float16"}, "fp16"),
    ],
)
def test_accepted_forms(value, mode):
    config, problems = complete_config(tiny_config(mixed_precision=value))
    assert problems == []
    assert mode_of(config["training"]["mixed_precision"]) == mode


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("float8", 'training.mixed_precision: must be null, "tf32", "bf16" or "fp16"'),
        (
            {"output_prec": "float32", "compute_prec": "float32"},
            'training.mixed_precision.compute_prec: must be "float16" or "bfloat16"',
        ),
        (
            {"output_prec": "float16", "compute_prec": "bfloat16"},
            'training.mixed_precision.output_prec: must be "float32" or "float64"',
        ),
        (True, 'training.mixed_precision: expected null, "tf32", "bf16", "fp16" or {'),
    ],
)
def test_unsupported_values_give_one_line(value, message):
    _, problems = complete_config(tiny_config(mixed_precision=value))
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_float64_networks_are_refused():
    model_config = tiny_config()["model"]
    model_config["descriptor"]["precision"] = "float32"
    with pytest.raises(
        MDTrainError, match=r'"bf16" needs float32 networks: set model\.fitting_net'
    ):
        check_networks("bf16", model_config, "training.mixed_precision")
    check_networks(None, model_config, "training.mixed_precision")  # off: anything goes


def test_check_and_train_report_float64_networks(tmp_path, capsys, caplog):
    inp = make_project(tmp_path, mixed_precision="tf32")
    assert main(["check", str(inp)]) == 1
    out = capsys.readouterr().out
    assert 'training.mixed_precision "tf32" needs float32 networks' in out
    assert main(["train", str(inp), "-o", str(tmp_path / "out")]) == 1
    assert main(["train", str(inp), "-o", str(tmp_path / "out"), "--mixed-precision", "off"]) == 0
    assert main(["train", str(inp), "--mixed-precision", "fp16"]) == 1  # float64 networks
    assert '"fp16" needs float32 networks' in capsys.readouterr().err + caplog.text


def _float32_project(root) -> object:
    inp = make_project(root)
    config = json.loads(inp.read_text())
    for part in ("descriptor", "fitting_net"):
        config["model"][part]["precision"] = "float32"
    inp.write_text(json.dumps(config))
    return inp


def test_bf16_training_tracks_float32_and_saves_a_float32_model(tmp_path):
    inp = _float32_project(tmp_path)
    runs = {}
    for name, extra in (("f32", []), ("bf16", ["--mixed-precision", "bf16"])):
        assert main(["train", str(inp), "-o", str(tmp_path / name), *extra]) == 0
        runs[name] = lcurve_rows(tmp_path / name / "lcurve.out")
    f32, bf16 = runs["f32"], runs["bf16"]
    assert np.isfinite(bf16[:, 1:]).all()
    assert bf16[-1, 2] < bf16[0, 2]  # the training loss goes down
    np.testing.assert_allclose(bf16[:, 1:-1], f32[:, 1:-1], rtol=0.05)
    assert not np.array_equal(bf16[:, 1:-1], f32[:, 1:-1])

    ckpt = tmp_path / "bf16" / "model.ckpt.pt"
    state = torch.load(ckpt, weights_only=True)
    assert state["mixed_precision"] == "bf16"
    assert state["config"]["training"]["mixed_precision"] == "bf16"
    resolved = json.loads((tmp_path / "bf16" / "out.json").read_text())
    assert resolved["training"]["mixed_precision"] == "bf16"
    f32_state = torch.load(tmp_path / "f32" / "model.ckpt.pt", weights_only=True)
    assert f32_state["mixed_precision"] is None

    model = load_model(ckpt)  # inference: float32 parameters, accelerated, no autocast
    assert model.backend in ("kernels", "fused") and compute_mode(model) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
