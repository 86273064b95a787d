"""Bad input ends `mdtrain train` early with one clear line and damages nothing on disk; a full
disk keeps the previous checkpoint; checkpoints never run code and carry plain JSON config.

Every bad-input case starts from a copy of one finished run (checkpoints, lcurve.out, out.json,
a model-statistics file and the `finished` marker in the output directory), breaks one thing,
and checks: exit code 1, exactly one ERROR line naming the culprit, no traceback, no sign of
statistics or training having started, and every file of the output directory byte-identical.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import mdtrain.train.checkpoint as ckpt_module
from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.neighbors.stat import compute_neighbor_stat
from tests.helpers.datagen import water_labeled
from tests.helpers.processes import clean_env, run_process
from tests.helpers.training import lcurve_rows, make_project, mdtrain_command, snapshot

STEPS = 2


def train(inp: Path, *extra: str) -> int:
    return main(["train", str(inp), "-o", str(inp.parent / "out"), *extra])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A project whose output directory holds a whole finished run (made once per module)."""
    root = tmp_path_factory.mktemp("finished")
    inp = make_project(root, numb_steps=STEPS, save_freq=1, stat_file="out/stat.h5")
    assert train(inp) == 0
    return root


@pytest.fixture
def project(finished_run, tmp_path) -> Path:
    """A private copy of ``finished_run``; returns its input.json."""
    root = tmp_path / "p"
    shutil.copytree(finished_run, root, symlinks=True)
    return root / "input.json"


def edit_config(inp: Path, change: Callable[[dict], None]) -> None:
    config = json.loads(inp.read_text())
    change(config)
    inp.write_text(json.dumps(config, indent=1))


def edit_array(system: Path, name: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    path = system / "set.000" / f"{name}.npy"
    np.save(path, change(np.load(path)))


def at(array: np.ndarray, index: tuple, value: float) -> np.ndarray:
    array[index] = value
    return array


def write_state(path: Path, state: dict) -> None:
    torch.save(state, path)


# ----------------------------------------------------------------------------- the cases


@dataclass
class Case:
    """One way to break a run: ``make(input_path) -> extra CLI arguments``."""

    make: Callable[[Path], list[str]]
    expect: list[str]  # substrings of the ERROR line
    before_neighbor_stat: bool = True  # found before the neighbour statistics start
    args: list[str] = field(default_factory=list)


def _config(change: Callable[[dict], None]) -> Callable[[Path], list[str]]:
    def make(inp: Path) -> list[str]:
        edit_config(inp, change)
        return []

    return make


def _set(path: str, value) -> Callable[[dict], None]:  # noqa: ANN001
    keys = path.split(".")

    def change(config: dict) -> None:
        node = config
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return change


def _malformed_json(inp: Path) -> list[str]:
    text = inp.read_text().splitlines()
    text[3] = text[3] + ","  # a trailing comma on line 4
    inp.write_text("\n".join(text[:5]) + "\n")
    return []


def _unknown_key(config: dict) -> None:
    config["training"]["disp_frq"] = 5


def _data(name: str, array: str, change) -> Callable[[Path], list[str]]:  # noqa: ANN001
    def make(inp: Path) -> list[str]:
        edit_array(inp.parent / "data" / name, array, change)
        return []

    return make


def _wrong_natoms(inp: Path) -> list[str]:
    edit_array(inp.parent / "data" / "train_b", "coord", lambda c: c[:, :-3])
    return []


def _foreign_element(inp: Path) -> list[str]:
    (inp.parent / "data" / "valid" / "type_map.raw").write_text("O\nC\n")
    return []


def _overlap(inp: Path) -> list[str]:
    def change(coord: np.ndarray) -> np.ndarray:
        coord[1, 3:6] = coord[1, 0:3]  # atoms 0 and 1 on top of each other in frame 1
        return coord

    edit_array(inp.parent / "data" / "train_a", "coord", change)
    return []


def _garbage_h5(inp: Path) -> list[str]:
    (inp.parent / "bad.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + os.urandom(300))
    edit_config(inp, _set("training.training_data.systems", ["bad.h5"]))
    return []


def _truncated_h5(inp: Path) -> list[str]:
    good = inp.parent / "good.h5"
    with h5py.File(good, "w") as f:  # a real system file, then cut in half
        group = f.create_group("sys")
        group.create_dataset("type.raw", data=np.zeros(4, dtype=np.int64))
        group.create_dataset("set.000/coord.npy", data=np.random.default_rng(0).random((2, 12)))
    data = good.read_bytes()
    (inp.parent / "bad.h5").write_bytes(data[: len(data) // 2])
    edit_config(inp, _set("training.training_data.systems", ["bad.h5"]))
    return []


def _damaged_h5_dataset(inp: Path) -> list[str]:
    """A file that opens, whose compressed force data are damaged: found when frames are read."""
    data = water_labeled(4, 6, 6.0, 5)
    arrays = {
        "coord.npy": data["coords"].reshape(4, -1),
        "box.npy": data["boxes"].reshape(4, 9),
        "energy.npy": data["energy"],
        "force.npy": data["force"].reshape(4, -1),
    }
    path = inp.parent / "bad.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("sys/type.raw", data=np.asarray(data["types"], dtype=np.int64))
        f.create_dataset("sys/type_map.raw", data=np.array(data["type_map"], dtype="S"))
        for name, values in arrays.items():
            f.create_dataset(f"sys/set.000/{name}", data=values, chunks=True, compression="gzip")
        chunk = f["sys/set.000/force.npy"].id.get_chunk_info(0)
    with open(path, "r+b") as f:
        f.seek(chunk.byte_offset + 2)
        f.write(b"\xff" * (chunk.size - 4))
    edit_config(inp, _set("training.training_data.systems", ["bad.h5"]))
    return []


def _empty_dir(inp: Path) -> list[str]:
    (inp.parent / "nothing").mkdir()
    edit_config(inp, _set("training.training_data.systems", ["nothing"]))
    return []


def _checkpoint(kind: str, option: str) -> Callable[[Path], list[str]]:
    def make(inp: Path) -> list[str]:
        good = inp.parent / "out" / f"model.ckpt-{STEPS}.pt"
        bad = inp.parent / "bad.pt"
        if kind == "truncated":
            data = good.read_bytes()
            bad.write_bytes(data[: len(data) // 2])
        elif kind == "garbage":
            bad.write_bytes(b"not a checkpoint at all")
        elif kind == "missing":
            pass
        else:
            state = torch.load(good, weights_only=True)
            if kind == "version":
                state["version"] = 99
            elif kind == "type_map":
                state["model_config"]["type_map"] = ["H", "O"]
            elif kind == "shapes":
                state["model_state"] = {
                    k: torch.cat([v, v]) if v.dim() else v for k, v in state["model_state"].items()
                }
            write_state(bad, state)
        return [option, str(bad)]

    return make


def _neighbor_stat(change: Callable[[dict], None]) -> Callable[[Path], list[str]]:
    def make(inp: Path) -> list[str]:
        stat = inp.parent / "nstat.json"
        assert main(["neighbor-stat", str(inp), "-o", str(stat)]) == 0
        data = json.loads(stat.read_text())
        change(data)
        stat.write_text(json.dumps(data))
        return ["--neighbor-stat-file", str(stat)]

    return make


def _corrupt_stat_file(inp: Path) -> list[str]:
    (inp.parent / "garbage.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 200)
    edit_config(inp, _set("training.stat_file", "garbage.h5"))
    return []


def _nan_with_stat_file(inp: Path) -> list[str]:
    """A NaN coordinate must be found even when no neighbour statistics are computed."""
    stat = inp.parent / "nstat.json"
    assert main(["neighbor-stat", str(inp), "-o", str(stat)]) == 0
    edit_array(inp.parent / "data" / "train_a", "coord", lambda c: at(c, (5, 7), np.nan))
    return ["--neighbor-stat-file", str(stat)]


def _missing_input(inp: Path) -> list[str]:
    inp.unlink()
    return []


def _both_restart_and_init(inp: Path) -> list[str]:
    ckpt = str(inp.parent / "out" / f"model.ckpt-{STEPS}.pt")
    return ["--restart", ckpt, "--init-model", ckpt]


def _strict_sel(config: dict) -> None:
    config["model"]["descriptor"]["sel"] = [2, 3]
    config["training"]["strict_sel"] = True


CASES = {
    "malformed-json": Case(_malformed_json, ["input.json", "line 4", "column"]),
    "unknown-key": Case(_config(_unknown_key), ["training.disp_frq", "disp_freq"]),
    "wrong-type": Case(_config(_set("training.numb_steps", "ten")), ["training.numb_steps"]),
    "rcut-smth-above-rcut": Case(
        _config(_set("model.descriptor.rcut_smth", 4.5)), ["rcut_smth", "rcut"]
    ),
    "negative-neuron": Case(_config(_set("model.descriptor.neuron", [-4, 8])), ["neuron"]),
    "negative-batch-size": Case(
        _config(_set("training.training_data.batch_size", -2)), ["batch_size"]
    ),
    "batch-size-list-length": Case(
        _config(_set("training.training_data.batch_size", [1, 2, 3])), ["batch_size", "3"]
    ),
    "missing-system": Case(
        _config(_set("training.training_data.systems", ["data/nope"])), ["data/nope"]
    ),
    "empty-systems": Case(_config(_set("training.training_data.systems", [])), ["systems"]),
    "directory-without-systems": Case(_empty_dir, ["nothing"]),
    "shape-disagrees-with-type-raw": Case(_wrong_natoms, ["train_b", "coord"]),
    "nan-coordinate": Case(
        _data("train_b", "coord", lambda c: at(c, (3, 4), np.nan)), ["train_b", "coord", "frame 3"]
    ),
    "inf-box": Case(
        _data("train_a", "box", lambda b: at(b, (2, 0), np.inf)), ["train_a", "box", "frame 2"]
    ),
    "nan-energy": Case(
        _data("valid", "energy", lambda e: at(e, (1,), np.nan)), ["valid", "energy", "frame 1"]
    ),
    "inf-force": Case(
        _data("train_a", "force", lambda f: at(f, (6, 10), -np.inf)),
        ["train_a", "force", "frame 6"],
    ),
    "nan-virial": Case(
        _data("train_b", "virial", lambda v: at(v, (0, 4), np.nan)),
        ["train_b", "virial", "frame 0"],
    ),
    "nan-coordinate-with-neighbor-stat-file": Case(_nan_with_stat_file, ["train_a", "frame 5"]),
    "element-not-in-type-map": Case(_foreign_element, ["valid", "C", "type_map"]),
    "overlapping-atoms": Case(
        _overlap, ["train_a", "frame 1", "overlap"], before_neighbor_stat=False
    ),
    "sel-too-small-strict": Case(
        _config(_strict_sel), ["sel", "[2, 3]", "strict_sel"], before_neighbor_stat=False
    ),
    "garbage-hdf5": Case(_garbage_h5, ["bad.h5"]),
    "truncated-hdf5": Case(_truncated_h5, ["bad.h5"]),
    "damaged-hdf5-dataset": Case(_damaged_h5_dataset, ["bad.h5", "force.npy", "cannot read"]),
    "restart-truncated-checkpoint": Case(_checkpoint("truncated", "--restart"), ["bad.pt"]),
    "restart-garbage-checkpoint": Case(_checkpoint("garbage", "--restart"), ["bad.pt"]),
    "restart-missing-checkpoint": Case(_checkpoint("missing", "--restart"), ["bad.pt"]),
    "restart-checkpoint-version": Case(_checkpoint("version", "--restart"), ["bad.pt", "version"]),
    "restart-checkpoint-type-map": Case(
        _checkpoint("type_map", "--restart"), ["bad.pt", "type_map"]
    ),
    "init-model-truncated-checkpoint": Case(_checkpoint("truncated", "--init-model"), ["bad.pt"]),
    "init-model-checkpoint-type-map": Case(
        _checkpoint("type_map", "--init-model"), ["bad.pt", "type_map"]
    ),
    "init-model-weights-do-not-fit": Case(
        _checkpoint("shapes", "--init-model"), ["bad.pt", "do not fit"]
    ),
    "restart-and-init-model": Case(_both_restart_and_init, ["--restart", "--init-model"]),
    "neighbor-stat-file-rcut": Case(_neighbor_stat(_set("rcut", 3.0)), ["nstat.json", "rcut"]),
    "neighbor-stat-file-data": Case(
        _neighbor_stat(_set("fingerprint", "0" * 64)), ["nstat.json", "data"]
    ),
    "neighbor-stat-file-type-map": Case(
        _neighbor_stat(_set("type_map", ["H", "O"])), ["nstat.json", "type_map"]
    ),
    "corrupt-model-stat-file": Case(_corrupt_stat_file, ["garbage.h5", "stat_file"]),
    "missing-input": Case(_missing_input, ["input.json", "no such file"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_fails_early_with_one_line_and_damages_nothing(name, project, capsys):
    case = CASES[name]
    out = project.parent / "out"
    capsys.readouterr()
    extra = case.make(project)
    before = snapshot(out)
    assert len(before) >= 6, before  # checkpoints, link, index, lcurve, out.json, stat, marker
    code = train(project, *extra)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "ERROR" in line]
    assert code == 1, err
    assert len(errors) == 1, err
    assert "Traceback" not in err
    for expected in case.expect:
        assert expected in errors[0], (expected, errors[0])
    assert "parameters; training for" not in err  # the model was never built
    assert "energy bias" not in err  # nor were its statistics computed
    if case.before_neighbor_stat:
        assert "neighbour statistics: min distance" not in err, err
    assert snapshot(out) == before


def test_cli_subprocess_prints_one_line_and_traceback_only_with_debug(project):
    edit_array(project.parent / "data" / "train_a", "energy", lambda e: at(e, (2,), np.inf))
    out = project.parent / "out"
    before = snapshot(out)
    cmd = mdtrain_command("train", str(project), "-o", str(out))
    run = run_process(cmd, 120, clean_env(threads=1))
    assert run.returncode == 1, run.describe()
    errors = [line for line in run.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "train_a" in errors[0] and "energy" in errors[0] and "frame 2" in errors[0]
    debug = run_process(mdtrain_command("--debug", *cmd[3:]), 120, clean_env(threads=1))
    assert debug.returncode == 1 and "Traceback" in debug.stderr, debug.describe()
    assert snapshot(out) == before


def test_small_sel_warns_with_the_numbers(tmp_path, capsys):
    """Without strict_sel a too small sel is kept, with one warning per type quoting both."""
    inp = make_project(tmp_path, numb_steps=1)
    edit_config(inp, _set("model.descriptor.sel", [2, 3]))
    assert train(inp) == 0
    err = capsys.readouterr().err
    systems = [open_system(str(p), ["O", "H"]) for p in sorted((tmp_path / "data").iterdir())]
    counts = compute_neighbor_stat(systems, 4.0, 2).max_nbor_size
    assert counts[0] > 2 and counts[1] > 3
    for t, given in enumerate([2, 3]):
        expected = f"sel[{t}] = {given} is smaller than the largest neighbour count {counts[t]}"
        assert any(expected in line and "WARNING" in line for line in err.splitlines()), err
    resolved = json.loads((tmp_path / "out" / "out.json").read_text())
    assert resolved["model"]["descriptor"]["sel"] == [2, 3]


# ----------------------------------------------------------------------------- full disk


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    """ENOSPC while step 4's checkpoint is written: a clear error, step 2's checkpoint, link and
    index intact, no temporary files; `--restart auto` then finishes the run."""
    inp = make_project(tmp_path, numb_steps=6, save_freq=2)
    out = tmp_path / "out"
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if "model.ckpt-4.pt" in target and target.endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(ckpt_module.os, "fsync", fsync)
    capsys.readouterr()
    assert train(inp) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "no space left on device" in errors[0] and "model.ckpt-4.pt" in errors[0]
    names = sorted(os.listdir(out))
    assert not [n for n in names if n.endswith(".tmp")], names
    assert "model.ckpt-4.pt" not in names and "finished" not in names
    assert torch.load(out / "model.ckpt-2.pt", weights_only=True)["step"] == 2
    assert os.path.realpath(out / "model.ckpt.pt") == str(out / "model.ckpt-2.pt")
    assert (out / "checkpoint").read_text().strip() == "model.ckpt-2.pt"

    monkeypatch.setattr(ckpt_module.os, "fsync", real_fsync)
    assert train(inp, "--restart", "auto") == 0
    assert (out / "finished").read_text().strip() == "6"
    assert lcurve_rows(out / "lcurve.out")[:, 0].tolist() == [1, 2, 4, 6]


def test_restart_auto_skips_a_corrupt_newest_checkpoint(finished_run, tmp_path, capsys):
    root = tmp_path / "p"
    shutil.copytree(finished_run, root, symlinks=True)
    out = root / "out"
    newest = out / f"model.ckpt-{STEPS}.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    edit_config(root / "input.json", _set("training.numb_steps", STEPS + 1))
    assert train(root / "input.json", "--restart", "auto") == 0
    err = capsys.readouterr().err
    assert "skipping unusable checkpoint" in err and f"model.ckpt-{STEPS - 1}.pt" in err
    assert torch.load(out / f"model.ckpt-{STEPS + 1}.pt", weights_only=True)["step"] == STEPS + 1


# ----------------------------------------------------------------------------- safe loading


class _RunsCode:
    """Unpickling this calls ``Path.touch(marker)``: a checkpoint that would run code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (Path(self.marker),))


def test_checkpoint_that_would_run_code_is_refused(project, capsys):
    marker = project.parent / "code-ran"
    state = torch.load(project.parent / "out" / f"model.ckpt-{STEPS}.pt", weights_only=True)
    state["config"]["payload"] = _RunsCode(str(marker))
    evil = project.parent / "evil.pt"
    torch.save(state, evil)
    before = snapshot(project.parent / "out")
    capsys.readouterr()
    assert train(project, "--restart", str(evil)) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "evil.pt" in errors[0] and "refused" in errors[0]
    assert not marker.exists()
    assert snapshot(project.parent / "out") == before
    torch.load(evil, weights_only=False)  # the file really would have run code
    assert marker.exists()


def _plain_json(value) -> bool:  # noqa: ANN001
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_json(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain_json(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


def test_checkpoint_configuration_is_plain_json(finished_run):
    state = torch.load(finished_run / "out" / f"model.ckpt-{STEPS}.pt", weights_only=True)
    for key in ("config", "model_config"):
        assert _plain_json(state[key]), key
        assert json.loads(json.dumps(state[key])) == state[key]
    assert (
        state["config"]["model"]["descriptor"]["sel"] == state["model_config"]["descriptor"]["sel"]
    )
    assert (finished_run / "out" / "finished").read_text().strip() == str(STEPS)
