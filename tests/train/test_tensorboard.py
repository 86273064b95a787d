"""``training.tensorboard``: without the tensorboard package a run stops before its first step
with one line; with a SummaryWriter (a recording stand-in here, so that the test needs no
tensorboard) the scalars are the learning curve's rows at the display steps that
``tensorboard_freq`` picks, in ``tensorboard_log_dir`` under the output directory."""

from __future__ import annotations

import sys
import types

import numpy as np

from mdtrain.cli import main
from tests.helpers.training import lcurve_rows, make_project


class RecordingWriter:
    """Stands in for torch.utils.tensorboard.SummaryWriter; keeps what it is given."""

    made: list[RecordingWriter] = []

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False
        RecordingWriter.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_missing_package_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    inp = make_project(tmp_path, numb_steps=2, tensorboard=True)
    assert main(["check", str(inp)]) == 0  # the key itself is valid
    capsys.readouterr()
    assert main(["train", str(inp), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "training.tensorboard: the tensorboard package is not installed "
        "(pip install 'mdtrain[tensorboard]' or pip install tensorboard)"
    )
    assert not any("Traceback" in line for line in err)


def test_scalars_follow_the_learning_curve(tmp_path, monkeypatch):
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = RecordingWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    RecordingWriter.made.clear()
    inp = make_project(
        tmp_path,
        numb_steps=6,
        disp_freq=2,
        tensorboard=True,
        tensorboard_log_dir="tb",
        tensorboard_freq=4,
    )
    out = tmp_path / "out"
    assert main(["train", str(inp), "-o", str(out)]) == 0
    (writer,) = RecordingWriter.made
    assert writer.log_dir == str(out / "tb") and writer.closed
    header = (out / "lcurve.out").read_text().splitlines()[0].split()[1:]
    rows = lcurve_rows(out / "lcurve.out")
    assert [int(r[0]) for r in rows] == [1, 2, 4, 6]
    steps = sorted({step for _, _, step in writer.scalars})
    assert steps == [1, 4]  # display steps that are multiples of 4, and step 1
    for row in rows:
        got = {tag: value for tag, value, step in writer.scalars if step == int(row[0])}
        if int(row[0]) not in steps:
            assert not got
            continue
        expected = {"Default/lr": row[-1]}
        for name, value in zip(header[1:-1], row[1:-1]):
            key, _, part = name.rpartition("_")
            expected[f"Default/{key}" + ("_val" if part == "val" else "")] = value
        assert got.keys() == expected.keys()
        for tag, value in expected.items():  # lcurve.out prints 3 significant digits, lr 2
            rtol = 3e-2 if tag == "Default/lr" else 6e-3
            np.testing.assert_allclose(got[tag], value, rtol=rtol, err_msg=tag)


def test_off_by_default(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    inp = make_project(tmp_path, numb_steps=1)
    assert main(["train", str(inp), "-o", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out" / "log").exists()
