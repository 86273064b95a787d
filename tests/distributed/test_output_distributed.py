"""A DOS model trained on 2 Gloo ranks: one step with per-rank batch 1 equals one step with
batch 2 on one rank in float64 (the output statistics are computed from the same frames on
every rank, and the DOS loss is a mean over frames). A property model's ``smooth_mae`` loss
is a sum over frames, as in DeePMD-kit, so its ranks' averaged gradients are half those of one
rank with the double batch: that equivalence does not hold for it, by DeePMD-kit's design."""

from __future__ import annotations

import json

import pytest

from tests.helpers.output_data import make_output_project
from tests.helpers.processes import clean_env, run_process, torchrun_command
from tests.helpers.training import load_params, max_param_diff, mdtrain_command

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180


def _project(root, batch_size: int):
    inp = make_output_project(root, "dos")
    config = json.loads(inp.read_text())
    config["training"].update(numb_steps=1, disp_freq=1, save_freq=1)
    config["training"]["training_data"]["batch_size"] = batch_size
    inp.write_text(json.dumps(config))
    return inp


def test_two_ranks_equal_one_rank_with_double_batch(tmp_path):
    two, one = _project(tmp_path / "two", 1), _project(tmp_path / "one", 2)
    cmd = torchrun_command("mdtrain", ["train", str(two), "-o", "out"], 2, extra=["-m"])
    run_process(cmd, TIMEOUT, clean_env(None), cwd=two.parent).check()
    single = mdtrain_command("train", str(one), "-o", "out")
    run_process(single, TIMEOUT, clean_env(None, threads=2), cwd=one.parent).check()
    a = load_params(two.parent / "out" / "model.ckpt-1.pt")
    b = load_params(one.parent / "out" / "model.ckpt-1.pt")
    assert max_param_diff(a, b) < 1e-10
    start = _project(tmp_path / "zero", 1)  # the step moved the parameters
    config = json.loads(start.read_text())
    config["learning_rate"]["start_lr"] = 1e-12
    config["learning_rate"]["stop_lr"] = 1e-12
    start.write_text(json.dumps(config))
    run_process(mdtrain_command("train", str(start), "-o", "out"), TIMEOUT, clean_env(None),
                cwd=start.parent).check()  # fmt: skip
    assert max_param_diff(a, load_params(start.parent / "out" / "model.ckpt-1.pt")) > 1e-6
