"""The batch controller inside training: `micro_batches` gives the whole batch's gradient and
the same run, and a checkpoint carries the split per size to the restarted run."""

from __future__ import annotations

import numpy as np
import torch

from mdtrain import memory
from mdtrain.cli import main
from mdtrain.config import load_config
from mdtrain.distributed import Runtime
from mdtrain.model.backend import build_model
from mdtrain.train.loop import Trainer, seed_everything
from mdtrain.train.prepare import open_datasets
from tests.helpers.training import lcurve_rows, load_params, make_project, max_param_diff

TRAIN_DATA = {"systems": ["data/train_a", "data/train_b"], "batch_size": 4}


def _first_step_gradient(root, **controller) -> tuple[list[torch.Tensor], int]:
    """The gradient of a Trainer's first step (the update is skipped) and the forward count."""
    inp = make_project(root, training_data=TRAIN_DATA, batch_controller=controller)
    config = load_config(str(inp))
    config["model"]["descriptor"]["sel"] = [16, 32]
    data = open_datasets(config, str(inp))
    seed_everything(7)
    model = build_model(config["model"], "cpu")
    runtime = Runtime(0, 1, 0, 1, torch.device("cpu"), "gloo")
    trainer = Trainer(config, model, data.train, data.valid, runtime, str(root / "out"))
    trainer.optimizer.step = lambda *args, **kwargs: None  # keep the gradient as it is
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    trainer.train_step(1e-3)
    return [p.grad.detach().clone() for p in trainer.params], len(forwards)


def test_fixed_micro_batches_give_the_whole_batch_gradient(tmp_path):
    whole, calls = _first_step_gradient(tmp_path / "whole")
    split, split_calls = _first_step_gradient(tmp_path / "split", micro_batches=3)
    assert calls == 1 and split_calls == 3  # 4 frames as 2 + 1 + 1
    assert whole[0].dtype == torch.float64
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


def train(input_path, *extra: str) -> int:
    return main(["train", str(input_path), "-o", str(input_path.parent / "out"), *extra])


def test_fixed_micro_batches_train_the_same_run(tmp_path):
    plain = make_project(tmp_path / "plain")
    fixed = make_project(tmp_path / "fixed", batch_controller={"micro_batches": 2})
    assert train(plain) == 0 and train(fixed) == 0
    a, b = (p.parent / "out" for p in (plain, fixed))
    assert (
        max_param_diff(load_params(a / "model.ckpt-6.pt"), load_params(b / "model.ckpt-6.pt"))
        < 1e-10
    )
    np.testing.assert_allclose(
        lcurve_rows(b / "lcurve.out"), lcurve_rows(a / "lcurve.out"), rtol=1e-10
    )


def _controller(path) -> dict:
    return torch.load(path, weights_only=True)["controller_state"]


def test_checkpoints_carry_the_split_per_size_to_the_restarted_run(tmp_path, monkeypatch):
    plain = make_project(tmp_path / "plain")
    assert train(plain) == 0
    # train_b's batch (2 frames × 24 atoms) does not fit whole, train_a's (2 × 18) does
    monkeypatch.setenv(memory.SIMULATE_ATOMS_ENV, "40")
    monkeypatch.delenv(memory.SIMULATE_RANKS_ENV, raising=False)
    full = make_project(tmp_path / "full")
    assert train(full) == 0
    out = full.parent / "out"
    at3 = _controller(out / "model.ckpt-3.pt")
    assert [(e["size"], e["nsplit"], e["ooms"]) for e in at3["sizes"]] == [(48, 2, 1)]
    assert _controller(out / "model.ckpt-6.pt")["oom_count"] == at3["oom_count"] == 1
    assert max_param_diff(
        load_params(out / "model.ckpt-6.pt"), load_params(plain.parent / "out" / "model.ckpt-6.pt")
    ) < 1e-10  # fmt: skip
    # a restart from step 3 knows the split: no new out-of-memory error
    part = make_project(tmp_path / "part")
    assert train(part) == 0
    (part.parent / "out" / "model.ckpt-6.pt").unlink()
    assert train(part, "--restart", str(part.parent / "out" / "model.ckpt-3.pt")) == 0
    assert _controller(part.parent / "out" / "model.ckpt-6.pt")["oom_count"] == 1
