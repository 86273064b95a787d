"""Device placement of the model and its statistics, checked without a GPU: the maths on the
``meta`` device (no values), everything that reads values on ``OtherDevice`` (CPU data behind
the device ``meta``, tests/helpers/placement.py). A CPU tensor meeting a tensor of the model's
device fails both, as it would on a GPU."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from mdtrain.data import open_system
from mdtrain.model.autocast import compute_mode
from mdtrain.model.backend import build_model, choose_backend, to_device
from mdtrain.model.config import normalize_model_config
from mdtrain.model.stats import collect_stat_batches, compute_or_load_stats, stat_inputs
from tests.helpers.descriptor_battery import battery_config
from tests.helpers.models import batch, set_random_stats, small_config
from tests.helpers.padded_stats import descriptor_stat_sums
from tests.helpers.placement import (
    OTHER,
    OtherDevice,
    PlacementError,
    iter_tensors,
    module_devices,
    nonzero_on_meta,
)

META = torch.device("meta")
CONFIGS = {
    "one_side": small_config(),
    "pairs_excluded": small_config(
        {"type_one_side": False, "exclude_types": [[0, 1]]}, atom_exclude_types=[1]
    ),
    "float32": small_config({"precision": "float32"}, {"precision": "float32"}),
}


def moved(tensors, device):
    return tuple(None if t is None else t.to(device) for t in tensors)


def on_cpu(model_config: dict, backend: str):
    return set_random_stats(build_model(model_config, "cpu", backend=backend))


def test_other_device_computes_and_refuses_cpu_tensors():
    """The harness itself: real values on the other device, a CPU operand refused."""
    with OtherDevice() as other:
        x = torch.arange(4.0, device=OTHER)
        y = (x * x).sum() + torch.tensor(1.0)  # a 0-dim CPU tensor may join, as on CUDA
        assert x.device == OTHER and float(y) == 15.0
        assert x[x > 1.0].cpu().tolist() == [2.0, 3.0]
        with pytest.raises(PlacementError, match="cpu"):
            x + torch.ones(4)
        with pytest.raises(PlacementError, match="aten.index"):
            x[torch.tensor([0, 1])]
        assert torch.zeros(2).device.type == "cpu"
        assert other.cpu_factories == ["aten.ones.default", "aten.zeros.default"]


@pytest.mark.parametrize("name", CONFIGS)
def test_reference_forward_and_backward_on_meta(name):
    cfg = CONFIGS[name]
    inputs = batch(on_cpu(cfg, "reference"))
    model = build_model(cfg, META, backend="reference").train()
    assert module_devices(model) == {META}
    with nonzero_on_meta():
        out = model(*moved(inputs, META))
        (out["energy"].sum() + out["force"].square().sum()).backward()
        with pytest.raises(RuntimeError, match="device"):
            model(*inputs)  # CPU inputs for a model elsewhere
    assert {t.device for t in out.values()} == {META}
    assert out["force"].shape == inputs[0].shape
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.device == META for g in grads)


def stat_batches(water_system: str, cfg: dict) -> tuple[list, list[dict]]:
    systems = [open_system(water_system, cfg["type_map"])]
    return systems, collect_stat_batches(systems, cfg, 2)


@pytest.mark.parametrize("name", ["one_side", "pairs_excluded"])
def test_descriptor_stat_sums_on_meta(water_system, name):
    """The statistics' tensor maths run on the model's device, wherever that is."""
    cfg = CONFIGS[name]
    _, batches = stat_batches(water_system, cfg)
    model = build_model(cfg, META, backend="reference")
    inputs = stat_inputs(batches[0], 0, 2, META)
    assert {t.device for t in inputs if t is not None} == {META}
    sums = descriptor_stat_sums(model, *inputs)
    assert sums.device == META and sums.shape == (2, 2, 3) and sums.dtype == torch.float64
    with pytest.raises(RuntimeError, match="device"):
        descriptor_stat_sums(model, *stat_inputs(batches[0], 0, 2, torch.device("cpu")))


# models whose forward reads values beyond se_e2_a's (a hybrid's members on the fused
# backend, se_e3_tebd's pairs of real slots): run with values only, on OtherDevice
VALUE_CONFIGS = {name: battery_config(name) for name in ("hybrid", "se_e3_tebd")}
ANOTHER_DEVICE = [(b, n) for b in ("reference", "fused") for n in CONFIGS]
ANOTHER_DEVICE += [("fused", "hybrid"), ("reference", "se_e3_tebd")]


@pytest.mark.parametrize("backend, name", ANOTHER_DEVICE)
def test_forward_and_backward_on_another_device(name, backend):
    """Both backends a GPU can run, with values: the same numbers as on the CPU, every output
    and gradient on the model's device, and no tensor made on the CPU on the way."""
    cfg = {**CONFIGS, **VALUE_CONFIGS}[name]
    reference = on_cpu(cfg, backend).train()
    inputs = batch(reference)
    expected = reference(*inputs)
    (expected["energy"].sum() + expected["force"].square().sum()).backward()
    with OtherDevice() as other:
        model = build_model(cfg, OTHER, backend=backend).train()
        model.load_state_dict(reference.state_dict())
        assert model.backend == backend and module_devices(model) == {OTHER}
        there = moved(inputs, OTHER)
        other.cpu_factories.clear()
        out = model(*there)
        (out["energy"].sum() + out["force"].square().sum()).backward()
        assert other.cpu_factories == []
        assert {t.device for t in iter_tensors(out)} == {OTHER}
        got = {k: v.detach().cpu() for k, v in out.items()}
        grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
        assert all(p.grad.device == OTHER for p in model.parameters() if p.grad is not None)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value.detach(), rtol=1e-12, atol=1e-12)
    for n, p in reference.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-12, atol=1e-12)


def test_a_gpu_never_gets_the_compiled_kernels():
    """The kernels take CPU tensors: any other device builds the fused backend."""
    assert build_model(CONFIGS["one_side"], META).backend == "fused"


def test_a_model_moved_to_another_device_gets_a_backend_that_runs_there():
    """``to_device`` (the calculator's move of a live model): a kernels model is rebuilt as the
    fused one with the same weights; a bf16 model keeps its low-precision layers."""
    cfg = CONFIGS["float32"]
    if choose_backend(normalize_model_config(cfg), torch.device("cpu"))[0] != "kernels":
        pytest.skip("the compiled kernels are not available here")
    cpu = on_cpu(cfg, "kernels").eval()
    inputs = batch(cpu)
    expected = cpu(*inputs)
    with OtherDevice():
        model = to_device(cpu, OTHER)
        assert model.backend == "fused" and not model.training
        assert module_devices(model) == {OTHER}
        got = {k: v.cpu() for k, v in model(*moved(inputs, OTHER)).items()}
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    bf16 = build_model(cfg, "cpu", mixed_precision="bf16")
    moved_bf16 = to_device(bf16, META)
    assert compute_mode(moved_bf16) == "bf16" and module_devices(moved_bf16) == {META}


@pytest.mark.parametrize("name", ["one_side", "pairs_excluded"])
def test_statistics_on_another_device_equal_the_cpu_ones(tmp_path, water_system, name):
    """Descriptor statistics and energy bias computed for a model on another device, then
    loaded from the stat file into another one: the CPU's numbers, in the model's buffers.
    (Before the fix the statistics mixed CPU inputs with the model's buffers and failed.)"""
    cfg = CONFIGS[name]
    systems = [open_system(water_system, cfg["type_map"])]
    cpu = build_model(cfg, "cpu", backend="reference")
    compute_or_load_stats(cpu, systems, None, 2)
    expected = {k: v for k, v in cpu.state_dict().items() if "davg" in k or "dstd" in k}
    expected |= {"out_bias": cpu.out_bias, "out_std": cpu.out_std}
    stat_file = str(tmp_path / "stat.h5")
    for round_ in ("computed", "loaded"):
        with OtherDevice():
            model = build_model(cfg, OTHER, backend="fused")
            compute_or_load_stats(model, systems, stat_file, 2)
            assert module_devices(model) == {OTHER}
            state = {k: v.cpu() for k, v in model.state_dict().items()}
        for key, value in expected.items():
            np.testing.assert_allclose(state[key], value, rtol=1e-12, atol=1e-14, err_msg=round_)
        with h5py.File(stat_file) as f:
            assert len(f) == 1  # written once, by the first round
