"""Training, checking and testing on mixed-type data (``real_atom_types.npy``) with se_e2_a:
each composition of a mixed-type system trains as a system of its own, ``batch_size:
"mixed:N"`` gives N frames per batch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.data import open_systems
from mdtrain.train.loop import make_sampler
from tests.helpers.datagen import mixed_labeled, write_npy_system
from tests.helpers.training import lcurve_rows, tiny_config

TYPE_MAP = ["O", "H", "X"]


def _project(root: Path, **training) -> Path:
    """A mixed-type training system (3 compositions, one with virtual atoms), a plain
    validation system, and an input whose type_map orders the elements its own way."""
    train = mixed_labeled(nframes=9, nmol=4, box_len=5.2, seed=3, virtual=True)
    write_npy_system(root / "data" / "mixed", set_size=5, **train)
    valid = mixed_labeled(nframes=2, nmol=4, box_len=5.2, seed=4, ncomp=1)
    write_npy_system(
        root / "data" / "valid", **valid | {"real_types": None, "types": valid["real_types"][0]}
    )
    config = tiny_config(**training)
    config["model"]["type_map"] = ["H", "O", "X"]
    config["training"]["training_data"] = {"systems": ["data/mixed"], "batch_size": "mixed:2"}
    config["training"]["validation_data"] = {"systems": ["data/valid"], "batch_size": 1}
    path = root / "input.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def test_sampler_draws_compositions_with_their_share_of_frames(tmp_path):
    path = _project(tmp_path)
    systems = open_systems(str(tmp_path / "data" / "mixed"), ["H", "O", "X"])
    assert [s.nframes for s in systems] == [3, 3, 3] and len({s.source for s in systems}) == 1
    config = json.loads(path.read_text())["training"]["training_data"]
    sampler = make_sampler(systems, config | {"auto_prob": "prob_uniform"}, 0, 1, "training_data")
    assert sampler.batch_sizes == [2, 2, 2]
    np.testing.assert_allclose(sampler.probs, [1 / 3] * 3)  # one system: split by batches
    drawn = [sampler.next_batch() for _ in range(30)]
    assert all(len(frames) == 2 for _, frames in drawn)
    assert {system for system, _ in drawn} == {0, 1, 2}


def test_check_train_neighbor_stat_and_test_on_mixed_data(tmp_path, capsys):
    path = _project(tmp_path, numb_steps=4, disp_freq=2, save_freq=4)
    assert main(["check", str(path)]) == 0
    assert capsys.readouterr().out.strip() == (
        "OK: 2 systems, 11 frames (training: 1 system, 9 frames; validation: 1 system, 2 frames)"
    )
    assert main(["neighbor-stat", str(path), "-o", str(tmp_path / "n.json")]) == 0
    assert "all types" in capsys.readouterr().out
    out = tmp_path / "out"
    assert main(["train", str(path), "-o", str(out)]) == 0
    rows = lcurve_rows(out / "lcurve.out")
    assert rows[:, 0].tolist() == [1, 2, 4] and np.isfinite(rows[:, 1:]).all()
    sel = json.loads((out / "out.json").read_text())["model"]["descriptor"]["sel"]
    assert isinstance(sel, list) and len(sel) == 3
    report = tmp_path / "test.json"
    model = str(out / "model.ckpt.pt")
    assert (
        main(
            [
                "test",
                "-m",
                model,
                "-s",
                str(tmp_path / "data" / "mixed"),
                "--json",
                str(report),
                "-d",
                str(tmp_path / "detail"),
            ]
        )  # fmt: skip
        == 0
    )
    # DeePMD-kit's detail files: the first system names the header, every frame a row
    lines = (tmp_path / "detail.e.out").read_text().splitlines()
    first = open_systems(str(tmp_path / "data" / "mixed"), ["H", "O", "X"])[0]
    assert lines[0] == f"# {first.path}: data_e pred_e" and len(lines) == 1 + 9
    per_system = json.loads(report.read_text())["systems"]
    mixed = str(tmp_path / "data" / "mixed")
    assert sorted(per_system) == sorted(s.path for s in open_systems(mixed, TYPE_MAP))
    assert [per_system[k]["natoms"] for k in sorted(per_system)] == [9, 12, 12]


def test_check_reports_a_bad_mixed_system_in_one_line(tmp_path, capsys):
    path = _project(tmp_path)
    types = tmp_path / "data" / "mixed" / "set.001" / "real_atom_types.npy"
    bad = np.load(types)
    bad[1, 0] = 7
    np.save(types, bad)
    config = json.loads(path.read_text())
    config["model"]["descriptor"]["sel"] = 40  # an integer sel: only the mixed-types ones
    path.write_text(json.dumps(config))
    assert main(["check", str(path)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [
        f"{path}: model.descriptor.sel: one integer for all types is taken only by se_atten, "
        "dpa1, se_atten_v2, se_e3_tebd; se_e2_a needs a list with one entry per element of "
        'model.type_map (or "auto")',
        f"{types}: frame 1 has type 7, but type_map.raw names 3 types (0..2; -1 marks a "
        "virtual atom)",
        "FAILED: 2 problems",
    ]
    assert os.path.isfile(types)


def test_a_type_mixed_hybrid_trains_freezes_and_tests_on_mixed_data(tmp_path):
    """se_atten beside se_e2_a (a type-mixed hybrid, sel "auto" per member) on mixed-type
    data with ``"mixed:2"``: trains, freezes to ``.dp``, and ``mdtrain test`` of the ``.dp``
    gives the checkpoint's figures on every composition."""
    path = _project(tmp_path, numb_steps=4, disp_freq=2, save_freq=4)
    config = json.loads(path.read_text())
    config["model"]["descriptor"] = {
        "type": "hybrid",
        "list": [
            {"type": "se_atten", "sel": "auto", "rcut": 3.5, "rcut_smth": 0.5,
             "neuron": [4, 8], "axis_neuron": 2, "tebd_dim": 3, "attn": 6, "attn_layer": 1},
            {"type": "se_e2_a", "sel": "auto", "rcut": 3.0, "rcut_smth": 0.5, "neuron": [4, 6]},
        ],
    }  # fmt: skip
    path.write_text(json.dumps(config))
    assert main(["check", str(path)]) == 0
    out = tmp_path / "out"
    assert main(["train", str(path), "-o", str(out)]) == 0
    assert np.isfinite(lcurve_rows(out / "lcurve.out")[:, 1:]).all()
    members = json.loads((out / "out.json").read_text())["model"]["descriptor"]["list"]
    assert isinstance(members[0]["sel"], int) and len(members[1]["sel"]) == 3
    frozen = tmp_path / "model.dp"
    assert main(["freeze", str(out / "model.ckpt.pt"), "-o", str(frozen)]) == 0
    figures = []
    for model in (out / "model.ckpt.pt", frozen):
        report = tmp_path / f"{model.name}.json"
        args = ["test", "-m", str(model), "-s", str(tmp_path / "data" / "mixed")]
        assert main([*args, "--json", str(report)]) == 0
        figures.append(json.loads(report.read_text())["systems"])
    assert len(figures[0]) == 3 and figures[0].keys() == figures[1].keys()
    for name, ours in figures[0].items():
        for key, value in ours.items():
            if isinstance(value, float):
                assert figures[1][name][key] == pytest.approx(value, rel=1e-12), (name, key)
