"""``mdtrain test -d``: DeePMD-kit 3.2's detail files, checked against the data files and the
model evaluated frame by frame in the files' atom order (the interop tier compares them with
``dp --pt test -d`` itself)."""

from __future__ import annotations

import re

import numpy as np

from mdtrain.cli import main
from tests.helpers.datagen import water_labeled, write_npy_system
from tests.helpers.models import evaluate, make_model, save_tiny_checkpoint

NUMBER = r"-?\d\.\d{18}e[+-]\d\d"


def project(tmp_path):
    """A model and two systems: water with every label, a cluster without forces or virials."""
    model = make_model(descriptor={"sel": [40, 80]})
    save_tiny_checkpoint(tmp_path / "model.pt", model)
    full = water_labeled(nframes=3, nmol=4, seed=1)
    write_npy_system(tmp_path / "water", **full)
    cluster = water_labeled(nframes=2, nmol=3, seed=2)
    cluster.update(boxes=None, force=None, virial=None)
    write_npy_system(tmp_path / "cluster", **cluster)
    return model, full, cluster


def test_detail_files_hold_labels_and_predictions(tmp_path, monkeypatch):
    model, full, cluster = project(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["test", "-m", "model.pt", "-s", "water", "cluster", "-d", "out/res.txt"]) == 1
    (tmp_path / "out").mkdir()
    assert main(["test", "-m", "model.pt", "-s", "water", "cluster", "-d", "out/res.txt"]) == 0
    base = tmp_path / "out" / "res"  # the suffix replaced, as pathlib's with_suffix does
    want = {"e": [], "f": [], "v": []}
    for data, nopbc in ((full, False), (cluster, True)):
        natoms = len(data["types"])
        for f, coord in enumerate(data["coords"]):
            box = None if nopbc else data["boxes"][f]
            out = evaluate(model, coord, box, np.asarray(data["types"]))  # the file's order
            label = {k: np.zeros(s) if data[k] is None else np.reshape(data[k][f], s)
                     for k, s in (("energy", (1,)), ("force", (natoms, 3)), ("virial", (9,)))}  # fmt: skip
            want["e"].append([float(label["energy"][0]), float(out["energy"])])
            want["f"].append(np.hstack([label["force"], out["force"]]))
            want["v"].append(np.hstack([label["virial"], out["virial"].reshape(9)]))
    natoms = np.array([12] * 3 + [9] * 2)[:, None]
    expected = {
        "e": np.array(want["e"]),
        "e_peratom": np.array(want["e"]) / natoms,
        "f": np.vstack(want["f"]),
        "v": np.array(want["v"]),
        "v_peratom": np.array(want["v"]) / natoms,
    }
    for suffix, values in expected.items():
        path = base.with_suffix(f".{suffix}.out")
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# water: data_") and sum(ln[0] == "#" for ln in lines) == 1
        assert re.fullmatch(" ".join([NUMBER] * values.shape[1]), lines[1])
        np.testing.assert_allclose(np.loadtxt(path), values, rtol=1e-12, atol=1e-12)
    assert (base.with_suffix(".f.out").read_text().splitlines()[0]
            == "# water: data_fx data_fy data_fz pred_fx pred_fy pred_fz")  # fmt: skip
    stress = np.loadtxt(base.with_suffix(".s.out"))  # only the periodic system has one
    volume = np.abs(np.linalg.det(np.reshape(full["boxes"], (-1, 3, 3))))[:, None]
    np.testing.assert_allclose(stress, -expected["v"][:3] / volume, rtol=1e-12, atol=1e-14)
    assert base.with_suffix(".s.out").read_text().startswith("# water (eV/Å³): data_sxx")


def test_a_later_run_replaces_the_files(tmp_path, monkeypatch):
    project(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["test", "-m", "model.pt", "-s", "water", "-d", "p"]) == 0
    first = (tmp_path / "p.e.out").read_text()
    assert main(["test", "-m", "model.pt", "-s", "cluster", "-d", "p"]) == 0
    assert (tmp_path / "p.e.out").read_text() != first
    assert (tmp_path / "p.e.out").read_text().startswith("# cluster:")
    assert not (tmp_path / "p.s.out").exists()  # the stale stress file of the first run
