"""`mdtrain plot`: parsing lcurve.out files in the DeePMD-compatible layout, and drawing them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.errors import MDTrainError
from mdtrain.plot import metric_groups, parse_lcurve, plot_lcurve

KEYS = ("rmse", "rmse_e", "rmse_f", "rmse_v")
NOTE = "# If there is no available reference data, rmse_*_{val,trn} will print nan\n"


def expected_values(step: int) -> dict[str, float]:
    """Synthetic metrics: decaying curves, validation a little above training, no virial labels."""
    values = {}
    for k, key in enumerate(KEYS):
        base = 10.0 ** (1 - k) * math.exp(-step / 400) + 1e-3
        values[key + "_val"] = math.nan if key == "rmse_v" else 1.2 * base
        values[key + "_trn"] = math.nan if key == "rmse_v" else base
    values["lr"] = 1e-3 * 0.9 ** (step / 50)
    return values


def write_lcurve(
    path: Path, steps, validation: bool = True, header_again_at: int | None = None
) -> Path:
    """Write rows the way the trainer does: '%7d', '   %11.2e' per metric, '   %8.1e' for lr."""
    splits = ("_val", "_trn") if validation else ("_trn",)
    per_key = [[key + s for s in splits] for key in KEYS]  # '   %11s %11s' per key, as written
    header = f"# {'step':>5}" + "".join("   " + " ".join(f"{n:>11}" for n in g) for g in per_key)
    header += f"   {'lr':>8}\n"
    lines = [header, NOTE]
    for n, step in enumerate(steps):
        if n == header_again_at:  # a restart appends a new header
            lines += [header, NOTE]
        v = expected_values(step)
        lines.append(
            f"{step:7d}"
            + "".join("   " + " ".join(f"{v[n]:11.2e}" for n in g) for g in per_key)
            + f"   {v['lr']:8.1e}\n"
        )
    path.write_text("".join(lines))
    return path


STEPS = [0, *range(99, 1000, 100)]


def test_parse_matches_written_values(tmp_path):
    columns = parse_lcurve(write_lcurve(tmp_path / "lcurve.out", STEPS))
    assert list(columns) == ["step"] + [k + s for k in KEYS for s in ("_val", "_trn")] + ["lr"]
    assert columns["step"].dtype == np.int64
    np.testing.assert_array_equal(columns["step"], STEPS)
    for name in ("rmse_e_val", "rmse_f_trn", "lr"):
        want = [
            float(("%11.2e" if name != "lr" else "%8.1e") % expected_values(s)[name]) for s in STEPS
        ]
        np.testing.assert_array_equal(columns[name], want)
    assert np.isnan(columns["rmse_v_val"]).all() and np.isnan(columns["rmse_v_trn"]).all()


def test_train_only_form_and_groups(tmp_path):
    columns = parse_lcurve(write_lcurve(tmp_path / "lcurve.out", STEPS, validation=False))
    assert "rmse_e_val" not in columns and "rmse_e_trn" in columns
    groups = metric_groups(columns)
    # The virial columns are all nan: no panel for them.
    assert list(groups) == ["rmse", "rmse_e", "rmse_f"]
    assert all(list(splits) == ["train"] for splits in groups.values())


def test_groups_pair_validation_and_train(tmp_path):
    columns = parse_lcurve(write_lcurve(tmp_path / "lcurve.out", STEPS))
    columns["rmse_v_val"] = np.linspace(
        1.0, 0.1, len(STEPS)
    )  # validation has virials, training not
    groups = metric_groups(columns)
    assert list(groups) == list(KEYS)
    assert sorted(groups["rmse_e"]) == ["train", "validation"]
    assert list(groups["rmse_v"]) == ["validation"]
    np.testing.assert_array_equal(groups["rmse_f"]["train"], columns["rmse_f_trn"])


def test_repeated_header_after_restart(tmp_path):
    columns = parse_lcurve(write_lcurve(tmp_path / "lcurve.out", STEPS, header_again_at=5))
    np.testing.assert_array_equal(columns["step"], STEPS)


def test_different_header_names_line(tmp_path):
    path = write_lcurve(tmp_path / "lcurve.out", STEPS[:3])
    text = path.read_text() + "#  step  rmse_trn  lr\n  399  1.0e-01  1.0e-03\n"
    path.write_text(text)
    with pytest.raises(MDTrainError, match=r"lcurve\.out:6: header names columns"):
        parse_lcurve(path)


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ("", r"no header line"),
        ("# just a comment\n", r"no header line"),
        ("      0   1.0e+00   1.0e-03\n", r"lcurve\.out:1: data before the header"),
        (
            "#  step  rmse_trn  lr\n      0   1.0e+00\n",
            r"lcurve\.out:2: 2 values, the header names 3",
        ),
        (
            "#  step  rmse_trn  lr\n\n      0   1.0e+00  1.0e-03\n     99   oops  1.0e-03\n",
            r"lcurve\.out:4: 'oops' is not a number",
        ),
    ],
)
def test_malformed_files(tmp_path, content, pattern):
    path = tmp_path / "lcurve.out"
    path.write_text(content)
    with pytest.raises(MDTrainError, match=pattern):
        parse_lcurve(path)


def test_missing_file(tmp_path):
    with pytest.raises(MDTrainError, match=r"nope\.out: no such file"):
        parse_lcurve(tmp_path / "nope.out")


def read_png(path: Path) -> np.ndarray:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path)


def test_cli_writes_a_png(tmp_path):
    lcurve = write_lcurve(tmp_path / "lcurve.out", STEPS)
    png = tmp_path / "lcurve.png"
    assert main(["plot", str(lcurve), "-o", str(png)]) == 0
    image = read_png(png)
    assert png.stat().st_size > 20_000
    # Drawn curves: many distinct colours, not a blank canvas.
    colours = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50
    # Three metric panels (no virial) and the learning rate: 2×2 panels, wider than tall.
    assert image.shape[1] > image.shape[0]


def test_virial_panel_when_present(tmp_path):
    columns = parse_lcurve(write_lcurve(tmp_path / "lcurve.out", STEPS))
    without = read_png(plot_lcurve(columns, tmp_path / "without.png"))
    columns["rmse_v_trn"] = np.geomspace(1.0, 0.01, len(STEPS))
    with_virial = read_png(plot_lcurve(columns, tmp_path / "with.png"))
    # Five panels need a third row.
    assert with_virial.shape[0] > 1.4 * without.shape[0]
    assert with_virial.shape[1] == without.shape[1]


def test_cli_errors_exit_1(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing.out"), "-o", str(tmp_path / "x.png")]) == 1
    assert "missing.out: no such file" in capsys.readouterr().err
    only_header = tmp_path / "lcurve.out"
    only_header.write_text("#  step  rmse_trn  lr\n" + NOTE)
    assert main(["plot", str(only_header), "-o", str(tmp_path / "x.png")]) == 1
    assert "no data rows" in capsys.readouterr().err
    lcurve = write_lcurve(tmp_path / "ok.out", STEPS)
    assert main(["plot", str(lcurve), "-o", str(tmp_path / "no" / "such" / "dir.png")]) == 1
    assert "no/such/dir.png: directory" in capsys.readouterr().err  # checked before parsing
    assert not (tmp_path / "x.png").exists()


def test_non_positive_values_are_not_fatal(tmp_path):
    columns = parse_lcurve(write_lcurve(tmp_path / "lcurve.out", STEPS))
    columns["rmse_trn"][0] = 0.0  # cannot be drawn on a log axis; skipped, not an error
    out = plot_lcurve(columns, tmp_path / "zero.png")
    assert read_png(out).size > 0


def test_unfinished_last_row_is_skipped(tmp_path):
    """A running training flushes whole rows; a row being written has no newline yet."""
    path = write_lcurve(tmp_path / "lcurve.out", STEPS[:4])
    path.write_text(path.read_text() + "    399      1.2")
    columns = parse_lcurve(path)
    np.testing.assert_array_equal(columns["step"], STEPS[:4])
    # A complete last row without its newline is kept.
    complete = write_lcurve(tmp_path / "complete.out", STEPS[:4]).read_text().rstrip("\n")
    (tmp_path / "complete.out").write_text(complete)
    np.testing.assert_array_equal(parse_lcurve(tmp_path / "complete.out")["step"], STEPS[:4])
    # The unfinished text with its newline is a malformed row.
    path.write_text(path.read_text() + "\n")
    with pytest.raises(MDTrainError, match=r"lcurve\.out:7: 2 values"):
        parse_lcurve(path)
