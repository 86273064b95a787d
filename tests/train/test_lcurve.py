"""lcurve.out: exact DeePMD column format, flushing, and restart without duplicate rows."""

import numpy as np
import torch

from mdtrain.train.lcurve import LcurveWriter, truncate_after

NOTE = "# If there is no available reference data, rmse_*_{val,trn} will print nan\n"


def test_exact_format_with_validation(tmp_path):
    path = tmp_path / "lcurve.out"
    with LcurveWriter(path, ["rmse_f", "rmse", "rmse_e"], has_validation=True, append=False) as w:
        w.write(
            1,
            1e-3,
            {"rmse": 12.5, "rmse_e": 0.031, "rmse_f": torch.tensor(0.4)},
            {"rmse": 13.0, "rmse_e": 0.05, "rmse_f": 0.45},
        )
        w.write(
            1000, 3.51e-8, {"rmse": 1.0, "rmse_e": 2e-4, "rmse_f": 0.03}
        )  # no validation values
    lines = path.read_text().splitlines(keepends=True)
    assert lines[0] == (
        "# step "
        "      rmse_val    rmse_trn"
        "    rmse_e_val  rmse_e_trn"
        "    rmse_f_val  rmse_f_trn"
        "   lr      \n"
    )
    assert lines[1] == NOTE
    assert lines[2] == (
        "      1"
        "      1.30e+01    1.25e+01"
        "      5.00e-02    3.10e-02"
        "      4.50e-01    4.00e-01"
        "    1.0e-03\n"
    )
    assert lines[3] == (
        "   1000"
        "           nan    1.00e+00"
        "           nan    2.00e-04"
        "           nan    3.00e-02"
        "    3.5e-08\n"
    )


def test_exact_format_training_only(tmp_path):
    path = tmp_path / "lcurve.out"
    with LcurveWriter(path, ["rmse", "rmse_v"], has_validation=False, append=False) as w:
        w.write(5, 2.5e-4, {"rmse": 0.5})
    assert path.read_text() == (
        "# step       rmse_trn    rmse_v_trn   lr      \n"
        + NOTE
        + "      5      5.00e-01           nan    2.5e-04\n"
    )


def test_rows_are_flushed_immediately(tmp_path):
    path = tmp_path / "lcurve.out"
    w = LcurveWriter(path, ["rmse"], has_validation=False, append=False)
    w.write(1, 1e-3, {"rmse": 1.0})
    assert path.read_text().count("\n") == 3  # readable before close
    w.close()


def write_rows(path, steps, append=False, resume_step=None):
    with LcurveWriter(path, ["rmse", "rmse_e"], True, append=append, resume_step=resume_step) as w:
        for s in steps:
            w.write(s, 1e-3, {"rmse": s, "rmse_e": 1.0}, {"rmse": s, "rmse_e": 2.0})


def test_restart_drops_rows_after_the_resumed_step(tmp_path):
    path = tmp_path / "lcurve.out"
    write_rows(path, [1, 100, 200, 300, 400])
    write_rows(path, [300, 400, 500], append=True, resume_step=200)
    text = path.read_text()
    assert text.count("# step") == 1 and text.count(NOTE) == 1
    data = np.loadtxt(path)
    assert data[:, 0].tolist() == [1, 100, 200, 300, 400, 500]


def test_append_removes_a_torn_last_row(tmp_path):
    path = tmp_path / "lcurve.out"
    write_rows(path, [1, 100])
    with open(path, "a") as f:
        f.write("    200      1.00e+0")  # the process was killed mid-row
    write_rows(path, [200], append=True)
    assert np.loadtxt(path)[:, 0].tolist() == [1, 100, 200]


def test_truncate_after_function_and_method(tmp_path):
    path = tmp_path / "lcurve.out"
    write_rows(path, [1, 10, 20, 30])
    assert truncate_after(path, 15) == 2
    assert np.loadtxt(path)[:, 0].tolist() == [1, 10]
    assert truncate_after(tmp_path / "missing.out", 5) == 0
    w = LcurveWriter(path, ["rmse", "rmse_e"], True, append=True)
    assert w.truncate_after(1) == 1
    w.write(2, 1e-3, {}, {})
    w.close()
    assert np.loadtxt(path)[:, 0].tolist() == [1, 2]


def test_append_to_missing_file_writes_header(tmp_path):
    path = tmp_path / "lcurve.out"
    write_rows(path, [7], append=True, resume_step=0)
    assert path.read_text().startswith("# step ")
    assert np.loadtxt(path, ndmin=2)[:, 0].tolist() == [7]
