"""What a run shows: ``training.disp_training`` and ``training.time_training`` as DeePMD-kit
defines them (nothing at all; no time per step), the progress line, and the warnings for
settings that train nothing (one-sided loss prefactors, ``model.data_stat_protect``)."""

from __future__ import annotations

import json

import pytest

from mdtrain.cli import main
from mdtrain.train.display import Display
from tests.helpers.training import lcurve_rows, make_project

KEYS = ["rmse", "rmse_e"]
METRICS = {"rmse": 1.5, "rmse_e": 0.25}


def test_due_on_the_first_and_every_disp_freq_step_unless_display_is_off():
    shown = Display(10, KEYS)
    assert [s for s in range(1, 11) if shown.due(s, 4)] == [1, 4, 8]
    hidden = Display(10, KEYS, show=False)
    assert not any(hidden.due(s, 4) for s in range(1, 11))


def test_line_leaves_out_time_and_eta_when_time_training_is_off():
    timed, untimed = Display(10, KEYS), Display(10, KEYS, timing=False)
    for display in (timed, untimed):
        display.add(0.5)
    assert timed.line(2, 1e-3, METRICS, None).endswith("0.500 s/step  ETA 0:00:04")
    line = untimed.line(2, 1e-3, METRICS, None)
    assert line == "step 2/10  rmse 1.500e+00  rmse_e 2.500e-01  lr 1.00e-03"


def test_for_run_reads_the_training_section():
    display = Display.for_run(5, KEYS, {"disp_training": False, "time_training": False})
    assert (display.show, display.timing) == (False, False)
    default = Display.for_run(5, KEYS, {})
    assert (default.show, default.timing) == (True, True)


def run(inp, capsys) -> tuple[list[str], list[str]]:
    """Train ``inp`` into ``out/`` beside it; (progress lines, warnings) it logged."""
    assert main(["train", str(inp), "-o", str(inp.parent / "out")]) == 0
    err = capsys.readouterr().err.splitlines()
    steps = [line.removeprefix("INFO ") for line in err if line.startswith("INFO step ")]
    return steps, [line for line in err if line.startswith("WARNING")]


def test_disp_training_false_shows_nothing_and_writes_no_rows(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=4, disp_training=False)
    assert run(inp, capsys)[0] == []
    lcurve = (tmp_path / "out" / "lcurve.out").read_text().splitlines()
    assert len(lcurve) == 2 and all(line.startswith("#") for line in lcurve)
    assert (tmp_path / "out" / "model.ckpt-4.pt").is_file()  # it trained all the same


def test_time_training_false_keeps_rows_and_drops_the_timing(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=4, time_training=False)
    lines = run(inp, capsys)[0]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "4/4"]
    assert not any("s/step" in line or "ETA" in line for line in lines)
    assert lcurve_rows(tmp_path / "out" / "lcurve.out")[:, 0].tolist() == [1, 2, 4]


@pytest.mark.parametrize(
    "loss, expected",
    [
        ({"start_pref_v": 0.0, "limit_pref_v": 1.0}, "virial term is off"),
        ({"start_pref_e": 0.02, "limit_pref_e": 0.0}, "energy term is off"),
    ],
)
def test_one_sided_prefactors_warn_and_drop_the_column(tmp_path, capsys, loss, expected):
    inp = make_project(tmp_path, numb_steps=1)
    config = json.loads(inp.read_text())
    config["loss"].update(loss)
    inp.write_text(json.dumps(config))
    warnings = run(inp, capsys)[1]
    assert any(expected in w for w in warnings)
    header = (tmp_path / "out" / "lcurve.out").read_text().splitlines()[0]
    term = expected.split()[0]
    assert f"rmse_{term[0]}_trn" not in header and "rmse_f_trn" in header


def test_data_stat_protect_other_than_default_warns_it_has_no_effect(tmp_path, capsys):
    inp = make_project(tmp_path, numb_steps=1)
    config = json.loads(inp.read_text())
    config["model"]["data_stat_protect"] = 0.05
    inp.write_text(json.dumps(config))
    warnings = run(inp, capsys)[1]
    assert any("model.data_stat_protect 0.05 has no effect" in w for w in warnings)
