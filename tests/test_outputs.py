"""``mdtrain.outputs``: every problem with where an output goes is one line naming the path —
a file in the way, a directory that takes no files, a full disk — and a good place is left
as it was (no probe file left behind, an existing file untouched)."""

from __future__ import annotations

import errno
import os
import tempfile

import pytest

from mdtrain import outputs
from mdtrain.errors import MDTrainError
from mdtrain.outputs import check_output_dir, check_output_file


@pytest.fixture
def unwritable(tmp_path) -> str:
    """A directory this process cannot create files in. Root ignores permission bits, so as
    root this is /sys (read-only to everyone); skipped where neither works."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        yield str(locked)
        locked.chmod(0o755)
        return
    try:
        fd, probe = tempfile.mkstemp(dir="/sys")
    except OSError:
        yield "/sys"
        return
    os.close(fd)
    os.unlink(probe)
    pytest.skip("no unwritable directory found for root here")


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_good_places_pass_and_leave_nothing_behind(tmp_path):
    existing = tmp_path / "model.pth"
    existing.write_text("old")
    check_output_file(existing, "-o")
    check_output_file(tmp_path / "new.json", "--json")
    check_output_dir(tmp_path, "-o")
    check_output_dir(tmp_path / "a" / "b", "-o")  # may be made later
    assert not (tmp_path / "a").exists()
    assert sorted(os.listdir(tmp_path)) == ["model.pth"] and existing.read_text() == "old"
    check_output_dir(tmp_path / "run" / "1", "-o", create=True)
    assert (tmp_path / "run" / "1").is_dir() and os.listdir(tmp_path / "run" / "1") == []


def test_a_file_in_the_way_of_a_directory(tmp_path):
    (tmp_path / "run1").write_text("")
    with pytest.raises(MDTrainError) as exc:
        check_output_dir(tmp_path / "run1", "output directory", create=True)
    assert one_line(exc) == (
        f"output directory {tmp_path}/run1: a file is in the way "
        f"({tmp_path}/run1 is a file, not a directory)"
    )
    with pytest.raises(MDTrainError, match=r"run1 is a file, not a directory"):
        check_output_dir(tmp_path / "run1" / "deeper", "-o", create=True)
    with pytest.raises(MDTrainError, match=r"-o .*/run1/x.json: a file is in the way"):
        check_output_file(tmp_path / "run1" / "x.json", "-o", create_parents=True)


def test_a_directory_where_a_file_goes_and_a_missing_parent(tmp_path):
    with pytest.raises(MDTrainError) as exc:
        check_output_file(tmp_path, "--json")
    assert one_line(exc) == f"--json {tmp_path}: is a directory, a file name is needed"
    with pytest.raises(MDTrainError, match="names a directory"):
        check_output_file(f"{tmp_path}/sub/", "-o")
    with pytest.raises(MDTrainError, match=r"directory .*/nope does not exist"):
        check_output_file(tmp_path / "nope" / "plot.png", "--parity")
    check_output_file(tmp_path / "nope" / "stat.json", "-o", create_parents=True)
    assert not (tmp_path / "nope").exists()


def test_a_directory_that_takes_no_files(unwritable):
    with pytest.raises(MDTrainError) as exc:
        check_output_file(os.path.join(unwritable, "model.pth"), "-o")
    assert one_line(exc).startswith(f"-o {unwritable}/model.pth: cannot create files in ")
    with pytest.raises(MDTrainError, match="cannot"):
        check_output_dir(os.path.join(unwritable, "run"), "output directory", create=True)


def test_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "free_bytes", lambda directory: 12 * 1024)
    with pytest.raises(MDTrainError) as exc:
        check_output_dir(tmp_path / "run", "output directory", create=True)
    assert one_line(exc) == (
        f"output directory {tmp_path}/run: no space left on the disk of {tmp_path}/run "
        "(12 KiB free)"
    )
    with pytest.raises(MDTrainError, match=r"-o .*/m.pth: no space left"):
        check_output_file(tmp_path / "m.pth", "-o")


def test_a_disk_too_full_for_the_probe_itself(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.tempfile, "mkstemp", full)
    with pytest.raises(MDTrainError, match=r"-o .*: no space left on the disk of "):
        check_output_file(tmp_path / "m.pth", "-o")


def test_enough_room_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "free_bytes", lambda directory: outputs.MIN_FREE_BYTES)
    check_output_file(tmp_path / "m.pth", "-o")
