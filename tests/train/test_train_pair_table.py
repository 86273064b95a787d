"""A DP+ZBL model (``use_srtab``) trains, tests and freezes to DeePMD-kit's ``.dp`` like an
energy model: the frozen file gives the checkpoint's figures, without the table file."""

from __future__ import annotations

import json

from tests.helpers.pair_tables import write_table, zbl_table
from tests.helpers.training import frozen_reports, make_project


def test_zbl_model_trains_freezes_and_tests(tmp_path):
    path = make_project(tmp_path, numb_steps=4, save_freq=4)
    config = json.loads(path.read_text())
    write_table(tmp_path / "zbl.txt", zbl_table(["O", "H"], 0.1, 4.0, 0.01, zero_from=3.5))
    config["model"].update(use_srtab="zbl.txt", smin_alpha=0.1, sw_rmin=0.8, sw_rmax=1.0)
    path.write_text(json.dumps(config))
    reports = frozen_reports(path, removed=tmp_path / "zbl.txt")  # both keep their table
    assert reports["ckpt"] == reports["dp"] and reports["dp"]
