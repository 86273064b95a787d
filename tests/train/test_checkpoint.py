"""Checkpoints: atomic writes under failure, safe loading, rotation, RNG state, SIGKILL."""

import errno
import logging
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import mdtrain.train.checkpoint as ckpt
from mdtrain.errors import MDTrainError
from mdtrain.model.files import load_checkpoint
from mdtrain.train.checkpoint import (
    CheckpointManager,
    load_rng_state,
    rng_state_dict,
    save_checkpoint,
)
from mdtrain.train.sampler import TrainingSampler


def make_state(step, size=10):
    model = torch.nn.Linear(size, 2).double()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, size, dtype=torch.float64)).sum().backward()
    opt.step()
    sampler = TrainingSampler([5, 8], [2, 3], [0.5, 0.5], seed=1)
    sampler.next_batch()
    return {
        "model_config": {"type_map": ["O", "H"], "descriptor": {"sel": [46, 92], "rcut": 6.0}},
        "model_state": model.state_dict(),
        "optimizer_state": opt.state_dict(),
        "step": step,
        "sampler_state": sampler.state_dict(),
        "rng_state": {0: rng_state_dict()},
        "config": {"training": {"numb_steps": 100, "seed": None}},
    }


def leftovers(directory):
    return [n for n in os.listdir(directory) if n.endswith(".tmp")]


def test_round_trip_with_weights_only(tmp_path):
    state = make_state(7)
    path = tmp_path / "a.pt"
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    assert loaded["format"] == "mdtrain-checkpoint" and loaded["version"] == 1
    assert loaded["step"] == 7
    assert loaded["model_config"] == state["model_config"]
    assert loaded["sampler_state"] == state["sampler_state"]
    for k, v in state["model_state"].items():
        assert torch.equal(loaded["model_state"][k], v)
    assert leftovers(tmp_path) == []


def _first_line_names(exc_info, path):
    msg = str(exc_info.value)
    assert "\n" not in msg
    assert str(path) in msg
    return msg


def test_load_errors_are_one_line_and_name_the_file(tmp_path):
    missing = tmp_path / "missing.pt"
    with pytest.raises(MDTrainError) as e:
        load_checkpoint(missing)
    assert "not found" in _first_line_names(e, missing)

    foreign = tmp_path / "foreign.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(MDTrainError) as e:
        load_checkpoint(foreign)
    assert "not an mdtrain checkpoint" in _first_line_names(e, foreign)

    future = tmp_path / "future.pt"
    torch.save({"format": "mdtrain-checkpoint", "version": 2}, future)
    with pytest.raises(MDTrainError) as e:
        load_checkpoint(future)
    assert "incompatible checkpoint version 2" in _first_line_names(e, future)

    good = tmp_path / "good.pt"
    save_checkpoint(good, make_state(1))
    data = good.read_bytes()
    for name, content in [
        ("trunc.pt", data[: len(data) // 2]),
        ("empty.pt", b""),
        ("garbage.pt", b"not a checkpoint at all " * 20),
    ]:
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(MDTrainError) as e:
            load_checkpoint(bad)
        msg = _first_line_names(e, bad)
        assert "corrupt" in msg or "not a valid" in msg


MARKER = None


def _payload(path):
    with open(path, "w") as f:
        f.write("code ran")


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_payload, (self.marker,))


def test_pickled_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    state = make_state(1)
    state["config"] = {"x": Evil(str(marker))}
    save_checkpoint(path, state)  # the writer does not police content; the reader does
    with pytest.raises(MDTrainError) as e:
        load_checkpoint(path)
    msg = _first_line_names(e, path)
    assert "refused" in msg and "_payload" in msg
    assert not marker.exists()
    # the payload is real: an unsafe load would have run it
    torch.load(path, weights_only=False)
    assert marker.read_text() == "code ran"


def _assert_previous_intact(path, step):
    assert load_checkpoint(path)["step"] == step
    assert leftovers(os.path.dirname(path)) == []


def test_failure_inside_torch_save_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    save_checkpoint(path, make_state(1))
    real_save = torch.save

    def broken_save(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a zip")
        raise RuntimeError("simulated crash while serialising")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(RuntimeError, match="simulated"):
        save_checkpoint(path, make_state(2))
    monkeypatch.setattr(torch, "save", real_save)
    _assert_previous_intact(path, 1)


def test_failure_in_rename_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    save_checkpoint(path, make_state(1))

    def broken_replace(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ckpt.os, "replace", broken_replace)
    with pytest.raises(MDTrainError, match="Input/output error"):
        save_checkpoint(path, make_state(2))
    monkeypatch.undo()
    _assert_previous_intact(path, 1)


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_full_disk_keeps_previous_and_names_the_file(tmp_path, monkeypatch, where):
    path = tmp_path / "model.pt"
    save_checkpoint(path, make_state(1))
    enospc = OSError(errno.ENOSPC, "No space left on device")
    if where == "fsync":

        def full(fd):
            raise enospc

        monkeypatch.setattr(ckpt.os, "fsync", full)
    else:
        real_fdopen = os.fdopen

        class FullFile:
            def __init__(self, f):
                self.f = f

            def write(self, data):
                self.f.write(bytes(data)[:100])  # part of it reaches the disk
                raise enospc

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        monkeypatch.setattr(ckpt.os, "fdopen", lambda fd, mode: FullFile(real_fdopen(fd, mode)))
    with pytest.raises(MDTrainError) as e:
        save_checkpoint(path, make_state(2))
    msg = _first_line_names(e, path)
    assert "no space left on device" in msg
    monkeypatch.undo()
    _assert_previous_intact(path, 1)


def test_manager_rotation_link_and_index(tmp_path):
    mgr = CheckpointManager(tmp_path, max_keep=3)
    assert mgr.latest() is None
    for step in range(1, 9):
        mgr.save(step, make_state(step))
    assert [s for s, _ in mgr.checkpoints()] == [6, 7, 8]
    assert os.path.islink(mgr.link_path)
    assert os.readlink(mgr.link_path) == "model.ckpt-8.pt"
    assert load_checkpoint(mgr.link_path)["step"] == 8
    assert (tmp_path / "checkpoint").read_text().strip() == "model.ckpt-8.pt"
    assert mgr.latest() == str(tmp_path / "model.ckpt-8.pt")
    assert leftovers(tmp_path) == []


def test_latest_skips_a_corrupt_newest_checkpoint(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, max_keep=5)
    for step in (10, 20, 30):
        mgr.save(step, make_state(step))
    newest = tmp_path / "model.ckpt-30.pt"
    newest.write_bytes(newest.read_bytes()[:300])
    with caplog.at_level(logging.WARNING, logger="mdtrain"):
        path, state = mgr.load_latest()
    assert path == str(tmp_path / "model.ckpt-20.pt") and state["step"] == 20
    assert "model.ckpt-30.pt" in caplog.text
    assert mgr.latest() == path


def test_saving_an_earlier_step_sets_later_checkpoints_of_an_old_run_aside(tmp_path):
    mgr = CheckpointManager(tmp_path, max_keep=10)
    for step in (100, 200, 300):
        mgr.save(step, make_state(step))
    mgr.save(200, make_state(200))
    assert [s for s, _ in mgr.checkpoints()] == [100, 200]
    assert mgr.latest().endswith("model.ckpt-200.pt")
    aside = tmp_path / "model.ckpt-300.pt.superseded"
    assert load_checkpoint(aside)["step"] == 300  # kept whole, out of reach of --restart auto
    for step in (300, 200):  # abandoned a second time: the first copy set aside stays
        mgr.save(step, make_state(step))
    assert load_checkpoint(tmp_path / "model.ckpt-300.pt.superseded.1")["step"] == 300
    assert load_checkpoint(aside)["step"] == 300
    assert [s for s, _ in mgr.checkpoints()] == [100, 200]


def test_copy_fallback_when_symlinks_fail(tmp_path, monkeypatch):
    def no_symlink(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(ckpt.os, "symlink", no_symlink)
    mgr = CheckpointManager(tmp_path, prefix="sub/model.ckpt", max_keep=2)
    mgr.save(1, make_state(1))
    mgr.save(2, make_state(2))
    link = tmp_path / "sub" / "model.ckpt.pt"
    assert link.is_file() and not link.is_symlink()
    assert load_checkpoint(link)["step"] == 2
    assert (tmp_path / "checkpoint").read_text().strip() == os.path.join("sub", "model.ckpt-2.pt")
    assert leftovers(tmp_path / "sub") == []


def test_rng_state_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    np.random.standard_normal()  # leave a cached gaussian in numpy's state
    save_checkpoint(tmp_path / "r.pt", {"rng_state": rng_state_dict()})
    expected = (torch.rand(5), np.random.rand(5), np.random.standard_normal(), random.random())
    state = load_checkpoint(tmp_path / "r.pt")
    load_rng_state(state["rng_state"])
    got = (torch.rand(5), np.random.rand(5), np.random.standard_normal(), random.random())
    assert torch.equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    assert got[2:] == expected[2:]


CHILD = r"""
import sys
import torch
from mdtrain.train.checkpoint import CheckpointManager
mgr = CheckpointManager(sys.argv[1], max_keep=3)
found = mgr.load_latest()
step = found[1]["step"] if found else 0
print("ready", step, flush=True)
w = torch.zeros(300_000, dtype=torch.float64)
while True:
    step += 1
    w.fill_(step)
    mgr.save(step, {"step": step, "model_state": {"w": w}})
"""


@pytest.mark.multiprocess
def test_sigkill_at_random_moments_always_leaves_a_loadable_newest_checkpoint(tmp_path):
    rng = random.Random(1234)
    mgr = CheckpointManager(tmp_path, max_keep=3)
    last = 0
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        ready = proc.stdout.readline().split()
        assert ready[0] == "ready" and int(ready[1]) == last  # resumed from the newest
        time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        for step, path in mgr.checkpoints():  # nothing half-written under a final name
            state = load_checkpoint(path)
            assert state["step"] == step and torch.all(state["model_state"]["w"] == step)
        found = mgr.load_latest()
        if found is None:
            assert last == 0
            continue
        path, state = found
        assert state["step"] >= last
        last = state["step"]
        assert load_checkpoint(mgr.link_path)["step"] >= last - 1
        index = (tmp_path / "checkpoint").read_text().strip()
        assert load_checkpoint(tmp_path / index)["step"] >= last - 1
    assert last > 0
