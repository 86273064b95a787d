"""Where a command writes is checked before it does any work: a file in the way, a directory
that takes no files or a full disk is one ``ERROR`` line naming the path and exit status 1,
with no traceback, for ``train -o``, ``neighbor-stat -o``, ``freeze -o``, ``test --json`` and
``--parity``, ``plot -o`` and ``convert -o``. The work itself (statistics, data reading,
neighbour lists, model loading) is replaced by a function that fails the test if called."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from mdtrain import outputs
from mdtrain.cli import main
from tests.helpers.models import save_tiny_checkpoint
from tests.helpers.training import make_project


def never(*args, **kwargs):
    raise AssertionError("work started although the output location is unusable")


@pytest.fixture
def no_work(monkeypatch):
    """Every command's first real work fails the test."""
    import mdtrain.commands.convert as convert_cmd
    import mdtrain.commands.freeze as freeze_cmd
    import mdtrain.commands.neighbor_stat as stat_cmd
    import mdtrain.commands.plot as plot_cmd
    import mdtrain.commands.test as test_cmd
    import mdtrain.data as data
    import mdtrain.train.run as run

    for module, name in (
        (run, "open_datasets"),
        (run, "_resolve_restart"),
        (stat_cmd, "compute_neighbor_stat"),
        (data, "expand_systems"),
        (freeze_cmd, "load_model_file"),
        (test_cmd, "load_model"),
        (plot_cmd, "parse_lcurve"),
        (convert_cmd, "convert"),
    ):
        monkeypatch.setattr(module, name, never)


@pytest.fixture
def project(tmp_path) -> Path:
    return make_project(tmp_path, numb_steps=1)


def commands(project: Path, target: str) -> dict[str, list[str]]:
    """Every command line that writes to ``target`` (a path that is unusable somehow)."""
    ckpt = save_tiny_checkpoint(project.parent / "model.ckpt.pt")
    system = str(project.parent / "data" / "valid")
    return {
        "train": ["train", str(project), "-o", target],
        "neighbor-stat": ["neighbor-stat", str(project), "-o", target],
        "neighbor-stat -s": [
            "neighbor-stat",
            "-s",
            system,
            "-r",
            "4",
            "-t",
            "O",
            "H",
            "-o",
            target,
        ],
        "freeze": ["freeze", ckpt, "-o", target],
        "test --json": ["test", "-m", ckpt, "-s", system, "--json", target],
        "test --parity": ["test", "-m", ckpt, "-s", system, "--parity", target],
        "plot": ["plot", str(project.parent / "lcurve.out"), "-o", target],
        "convert npy": ["convert", system, "-o", target, "--to", "deepmd/npy"],
        "convert h5": ["convert", system, "-o", target, "--to", "deepmd/hdf5"],
    }


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.err + captured.out).splitlines() if ln.startswith("ERROR")]
    assert "Traceback" not in captured.err
    assert len(lines) == 1, captured.err
    return lines[0]


NAMES = [
    "train",
    "neighbor-stat",
    "neighbor-stat -s",
    "freeze",
    "test --json",
    "test --parity",
    "plot",
    "convert npy",
    "convert h5",
]


@pytest.mark.parametrize("name", NAMES)
def test_a_file_in_the_way(project, capsys, no_work, name):
    blocker = project.parent / "blocker"
    blocker.write_text("keep me")
    # a directory is needed where a file is (train, convert npy), or the file's directory is a
    # file: both are "a file in the way"
    target = str(blocker) if name in ("train", "convert npy") else str(blocker / "out.x")
    assert main(commands(project, target)[name]) == 1
    line = error_line(capsys)
    assert target in line and f"a file is in the way ({blocker} is a file" in line
    assert blocker.read_text() == "keep me"


def test_train_into_an_existing_file_names_it(project, capsys, no_work):
    """The reported case: ``-o PATH`` where PATH is a file gave a FileExistsError traceback."""
    target = project.parent / "run1"
    target.write_text("")
    assert main(["train", str(project), "-o", str(target)]) == 1
    assert error_line(capsys) == (
        f"ERROR output directory {target}: a file is in the way ({target} is a file, not a "
        "directory)"
    )


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("train", "convert npy")])
def test_a_directory_where_the_file_goes(project, capsys, no_work, name):
    target = project.parent / "a_dir"
    target.mkdir()
    assert main(commands(project, str(target))[name]) == 1
    assert f"{target}: is a directory" in error_line(capsys)


def unwritable_dir(tmp_path: Path) -> str:
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return str(locked)
    try:  # root ignores permission bits; /sys is read-only to everyone
        fd, probe = tempfile.mkstemp(dir="/sys")
    except OSError:
        return "/sys"
    os.close(fd)
    os.unlink(probe)
    pytest.skip("no unwritable directory found for root here")


@pytest.mark.parametrize("name", NAMES)
def test_a_directory_that_takes_no_files(project, capsys, no_work, name):
    target = os.path.join(unwritable_dir(project.parent), "out.x")
    assert main(commands(project, target)[name]) == 1
    line = error_line(capsys)
    assert target in line and "cannot" in line


@pytest.mark.parametrize("name", NAMES)
def test_a_full_disk(project, capsys, no_work, monkeypatch, name):
    monkeypatch.setattr(outputs, "free_bytes", lambda directory: 0)
    target = str(project.parent / "out.x")
    assert main(commands(project, target)[name]) == 1
    line = error_line(capsys)
    assert target in line and "no space left on the disk" in line
