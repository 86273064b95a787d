"""Training and inference on real GPUs (marker ``gpu``, skipped without CUDA): one GPU in the
process and through the commands, and two ranks over NCCL where two GPUs exist. Machines
without a GPU check the same placement with ``OtherDevice`` (the test_placement modules)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ase import Atoms

from mdtrain.data import open_system
from mdtrain.infer.calculator import MDTrainCalculator
from mdtrain.infer.load import load_model
from mdtrain.model.backend import build_model
from mdtrain.model.files import load_checkpoint
from mdtrain.model.stats import compute_or_load_stats
from mdtrain.train.optimizer import make_adam, reserve_state
from tests.helpers.models import batch, small_config, triclinic, water_like
from tests.helpers.placement import iter_tensors, module_devices
from tests.helpers.processes import clean_env, run_process, torchrun_command
from tests.helpers.training import lcurve_rows, make_project, max_param_diff, mdtrain_command

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL training)"
)
TIMEOUT = 300  # CUDA start-up and NCCL rendezvous are slow
GPU = torch.device("cuda", 0)
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def mdtrain(cwd, *args: str, env: dict | None = None):
    """``python -m mdtrain ...`` in a subprocess (so that the CPU runs can hide the GPU)."""
    return run_process(mdtrain_command(*args), TIMEOUT, clean_env(env, threads=2), cwd=cwd).check()


def params(path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights on the CPU, wherever they were trained."""
    return load_checkpoint(path)["model_state"]


def test_statistics_and_a_step_on_the_gpu_equal_the_cpu(water_system):
    """The first GPU run without a stat file: statistics on the model's device, then one
    forward, backward and fused Adam step, every tensor on the GPU, the CPU's numbers."""
    cfg = small_config({"exclude_types": [[0, 1]]})
    systems = [open_system(water_system, cfg["type_map"])]
    models = {}
    for device in ("cpu", GPU):
        model = build_model(cfg, device, backend=None if device == GPU else "fused")
        compute_or_load_stats(model, systems, None, 2)
        models[device] = model
    gpu, cpu = models[GPU], models["cpu"]
    assert gpu.backend == "fused" and module_devices(gpu) == {GPU}
    for key, value in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[key].cpu(), value, rtol=1e-10, atol=1e-12)
    inputs = batch(cpu)
    results = {}
    for device, model in models.items():
        model.train()
        optimizer = make_adam([p for p in model.parameters() if p.requires_grad], 1e-3)
        reserve_state(optimizer)
        assert optimizer.defaults["fused"]  # CUDA's and the CPU's Adam is the fused kernel
        out = model(*(None if t is None else t.to(device) for t in inputs))
        (out["energy"].sum() + out["force"].square().sum()).backward()
        optimizer.step()
        assert {t.device for t in iter_tensors(out)} == {torch.device(device)}
        moments = [s["exp_avg"] for s in optimizer.state.values()]
        assert moments and {m.device for m in moments} == {torch.device(device)}
        results[device] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    assert max_param_diff(results[GPU], results["cpu"]) < 1e-9


def test_training_testing_and_restart_on_one_gpu(tmp_path):
    """``mdtrain train`` on the GPU equals the run on the CPU (same fused backend); its
    checkpoint continues on the GPU, loads on the CPU, and ``mdtrain test`` agrees on both."""
    inp = make_project(tmp_path)
    gpu = mdtrain(tmp_path, "train", str(inp), "-o", "gpu")
    assert "device cuda:0" in gpu.stderr and "model backend: fused" in gpu.stderr, gpu.stderr
    mdtrain(tmp_path, "train", str(inp), "-o", "cpu", env={**NO_GPU, "MDTRAIN_BACKEND": "fused"})
    rows = {d: lcurve_rows(tmp_path / d / "lcurve.out") for d in ("gpu", "cpu")}
    assert rows["gpu"][:, 0].tolist() == [1, 2, 4, 6]
    np.testing.assert_allclose(rows["gpu"][0], rows["cpu"][0], rtol=1e-8)  # before any update
    np.testing.assert_allclose(rows["gpu"], rows["cpu"], rtol=1e-5)
    weights = {d: params(tmp_path / d / "model.ckpt-6.pt") for d in ("gpu", "cpu")}
    assert max_param_diff(weights["gpu"], weights["cpu"]) < 1e-6
    state = load_checkpoint(tmp_path / "gpu" / "model.ckpt-6.pt")  # onto the CPU
    assert {t.device.type for t in iter_tensors(state)} == {"cpu"}
    assert module_devices(load_model(tmp_path / "gpu" / "model.ckpt-6.pt", "cpu")) == {
        torch.device("cpu")
    }
    figures = {}
    for name, env in (("gpu", None), ("cpu", NO_GPU)):
        report = tmp_path / f"test-{name}.json"
        ckpt = str(tmp_path / "gpu" / "model.ckpt.pt")
        mdtrain(tmp_path, "test", "-m", ckpt, "-s", "data/valid", "--json", str(report), env=env)
        figures[name] = json.loads(report.read_text())["total"]
    assert figures["gpu"].keys() == figures["cpu"].keys()
    for key, value in figures["cpu"].items():
        assert figures["gpu"][key] == pytest.approx(value, rel=1e-8), key
    config = json.loads(inp.read_text())
    config["training"]["numb_steps"] = 8
    inp.write_text(json.dumps(config))
    mdtrain(tmp_path, "train", str(inp), "-o", "gpu", "--restart", "auto")
    assert lcurve_rows(tmp_path / "gpu" / "lcurve.out")[:, 0].tolist() == [1, 2, 4, 6, 8]


def test_calculator_on_the_gpu_equals_the_cpu(tmp_path):
    ckpt = tmp_path / "model.pt"
    model = build_model(small_config(), "cpu")
    torch.save(
        {
            "format": "mdtrain-checkpoint",
            "version": 1,
            "step": 0,
            "model_config": model.get_model_config(),
            "model_state": model.state_dict(),
        },
        ckpt,
    )
    box = triclinic(5.2, seed=4)
    coord, atype = water_like(3, box, seed=4)
    atoms = Atoms(["OH"[t] for t in atype], positions=coord, cell=box, pbc=True)
    results = {}
    for device in ("cpu", GPU):
        for source in (str(ckpt), model):  # a file, and a live CPU model moved over
            calc = MDTrainCalculator(source, device=device)
            assert module_devices(calc.model) == {torch.device(device)}
            assert device != GPU or calc.model.backend == "fused"
            results[device, isinstance(source, str)] = {
                n: np.copy(calc.get_property(n, atoms)) for n in ("energy", "forces", "stress")
            }
    for (device, _), got in results.items():
        for name, value in results["cpu", True].items():
            np.testing.assert_allclose(
                got[name], value, rtol=1e-10, atol=1e-10, err_msg=f"{name} on {device}"
            )


@two_gpus
@pytest.mark.multiprocess
def test_two_ranks_over_nccl_equal_one_gpu_with_double_batch(tmp_path):
    """One step with per-rank batch b on 2 GPUs (NCCL) = one step with 2b on one GPU."""
    two = make_project(
        tmp_path / "two",
        numb_steps=1,
        training_data={"systems": ["data/train_a", "data/train_b"], "batch_size": 1},
    )
    one = make_project(
        tmp_path / "one",
        numb_steps=1,
        training_data={"systems": ["data/train_a", "data/train_b"], "batch_size": 2},
    )
    cmd = torchrun_command(
        "mdtrain", ["train", str(two), "-o", "out", "--backend", "nccl"], 2, extra=["-m"]
    )
    run = run_process(cmd, TIMEOUT, clean_env(), cwd=two.parent).check()
    assert run.stderr.count("2 rank(s), backend nccl, device cuda:0") == 1, run.stderr
    mdtrain(one.parent, "train", str(one), "-o", "out")
    a = params(two.parent / "out" / "model.ckpt-1.pt")
    b = params(one.parent / "out" / "model.ckpt-1.pt")
    assert max_param_diff(a, b) < 1e-8
