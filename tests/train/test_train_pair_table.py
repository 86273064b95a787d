"""A DP+ZBL model (``use_srtab``) trains, tests and freezes to DeePMD-kit's ``.dp`` like an
energy model: the frozen file gives the checkpoint's figures, without the table file."""

from __future__ import annotations

import json

from mdtrain.cli import main
from tests.helpers.pair_tables import write_table, zbl_table
from tests.helpers.training import make_project


def test_zbl_model_trains_freezes_and_tests(tmp_path):
    path = make_project(tmp_path, numb_steps=4, save_freq=4)
    config = json.loads(path.read_text())
    write_table(tmp_path / "zbl.txt", zbl_table(["O", "H"], 0.1, 4.0, 0.01, zero_from=3.5))
    config["model"].update(use_srtab="zbl.txt", smin_alpha=0.1, sw_rmin=0.8, sw_rmax=1.0)
    path.write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["train", str(path), "-o", str(out)]) == 0
    ckpt, frozen = out / "model.ckpt.pt", tmp_path / "model.dp"
    assert main(["freeze", str(ckpt), "-o", str(frozen)]) == 0
    (tmp_path / "zbl.txt").unlink()  # both keep their table
    valid = str(tmp_path / "data" / "valid")
    reports = {}
    for name, model in (("ckpt", ckpt), ("dp", frozen)):
        report = tmp_path / f"{name}.json"
        assert main(["test", "-m", str(model), "-s", valid, "--json", str(report)]) == 0
        reports[name] = json.loads(report.read_text())
        assert reports[name].pop("model") == str(model)
    assert reports["ckpt"] == reports["dp"] and reports["dp"]
