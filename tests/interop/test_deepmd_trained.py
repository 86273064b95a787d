"""A model trained by DeePMD-kit, used by mdtrain: ``dp --tf train`` (50 steps on generated
water data), ``dp --tf freeze``, ``dp convert-backend frozen_model.pb model.dp``; then
``mdtrain test -m model.dp -s SYSTEM`` gives ``dp test -m frozen_model.pb -s SYSTEM``'s
errors, and mdtrain's per-frame energies, atom energies, forces and virials are DeePMD-kit's
(``DeepPot`` on the frozen graph; energies also from its numpy ``.dp`` evaluator).
Every descriptor mdtrain reads (``tests/helpers/deepmd_variants.py``: se_e2_a both
``type_one_side`` settings, se_e2_r, se_e3, se_atten, se_atten_v2, hybrid), and se_e3_tebd,
which DeePMD-kit's TensorFlow backend lacks, trained, frozen and tested by its PyTorch
backend (``--pt``, ``frozen_model.pth``; ``MDTRAIN_DEEPMD_PT_PYTHON``).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.infer.load import load_model
from tests.helpers.datagen import water_labeled, write_npy_system
from tests.helpers.deepmd import frames_npz, rel_diff
from tests.helpers.deepmd_variants import BACKENDS, VARIANTS, training_input
from tests.helpers.models import evaluate

pytestmark = pytest.mark.interop

KEYS = ("energy", "atom_energy", "force", "virial")
# dp test's name -> mdtrain test's JSON key
FIGURES = {"Energy RMSE": "energy_rmse", "Force  RMSE": "force_rmse", "Virial RMSE": "virial_rmse"}


def dp_test_figures(output: str) -> dict[str, float]:
    """The last (all-systems) value of each FIGURES line that ``dp test`` logged."""
    found = {}
    for name, key in FIGURES.items():
        values = re.findall(rf"{name}\s*:\s*(\S+)", output)
        assert values, f"no {name!r} in dp test's output"
        found[key] = float(values[-1])
    return found


@pytest.fixture(scope="module", params=list(VARIANTS))
def trained(request, tmp_path_factory) -> dict:
    descriptor, fitting, backend = VARIANTS[request.param]
    deepmd = request.getfixturevalue("deepmd_pt" if backend == "pt" else "deepmd")
    flag, suffix = BACKENDS[backend]
    frozen = f"frozen_model{suffix}"
    tmp = tmp_path_factory.mktemp(f"dp_{request.param}")
    write_npy_system(tmp / "data", **water_labeled(20, seed=41))
    test = water_labeled(4, seed=42, triclinic=True)
    system = write_npy_system(tmp / "test", **test)
    config = training_input(descriptor, fitting)
    (tmp / "input.json").write_text(json.dumps(config, indent=1))
    deepmd.dp_cmd([flag, "train", "input.json"], tmp)
    deepmd.dp_cmd([flag, "freeze", "-o", frozen], tmp)
    deepmd.dp_cmd(["convert-backend", frozen, "model.dp"], tmp)
    dp_test = deepmd.dp_cmd([flag, "test", "-m", frozen, "-s", "test", "-d", "detail"], tmp)
    frames_npz(tmp / "frames.npz", test["coords"], test["types"], test["boxes"])
    errors = deepmd.driver(
        {
            "evaluate": [
                {"model": m, "frames": "frames.npz", "out": f"{m}.npz"}
                for m in (frozen, "model.dp")
            ]
        },
        tmp,
    )
    assert not errors, errors
    assert (
        main(["test", "-m", str(tmp / "model.dp"), "-s", system, "--json", str(tmp / "mt.json")])
        == 0
    )
    model = load_model(tmp / "model.dp")
    frames = [evaluate(model, c, b, test["types"]) for c, b in zip(test["coords"], test["boxes"])]
    return {
        "dp_test": dp_test_figures(dp_test),
        "detail_e": np.loadtxt(tmp / "detail.e.out", ndmin=2),
        "detail_f": np.loadtxt(tmp / "detail.f.out", ndmin=2),
        "detail_v": np.loadtxt(tmp / "detail.v.out", ndmin=2),
        "mdtrain_test": json.loads((tmp / "mt.json").read_text())["total"],
        "ours": {k: np.stack([f[k] for f in frames]) for k in KEYS},
        "frozen": dict(np.load(tmp / f"{frozen}.npz")),
        "dp": dict(np.load(tmp / "model.dp.npz")),
        "types": test["types"],
        "labels": test,
    }


def test_mdtrain_test_gives_dp_tests_errors(trained):
    """The printed figures to their 7 digits; recomputed from dp test's detail files (its
    labels and predictions in full precision) to 1e-8."""
    ours, printed = trained["mdtrain_test"], trained["dp_test"]
    e, f, v = trained["detail_e"], trained["detail_f"], trained["detail_v"]
    detail = {
        "energy_rmse": float(np.sqrt(np.mean((e[:, 1] - e[:, 0]) ** 2))),
        "force_rmse": float(np.sqrt(np.mean((f[:, 3:] - f[:, :3]) ** 2))),
        "virial_rmse": float(np.sqrt(np.mean((v[:, 9:] - v[:, :9]) ** 2))),
    }
    diffs = {k: abs(ours[k] - detail[k]) / detail[k] for k in detail}
    print("mdtrain test vs dp test (relative):", {k: f"{d:.1e}" for k, d in diffs.items()})
    for key in FIGURES.values():
        assert ours[key] == pytest.approx(printed[key], rel=1e-6), key
        assert diffs[key] < 1e-8, (key, ours[key], detail[key])


def test_dp_test_predictions_are_mdtrains(trained):
    """dp test's per-frame predictions (its detail files, atoms in the system's order)."""
    ours, e, f, v = trained["ours"], trained["detail_e"], trained["detail_f"], trained["detail_v"]
    nframes = len(e)
    assert rel_diff(e[:, 1], ours["energy"]) < 1e-10
    assert rel_diff(f[:, 3:].reshape(nframes, -1, 3), ours["force"]) < 1e-10
    assert rel_diff(v[:, 9:].reshape(nframes, 3, 3), ours["virial"]) < 1e-10
    np.testing.assert_allclose(e[:, 0], trained["labels"]["energy"], rtol=1e-12)


def test_deeppot_gives_mdtrains_frames(trained):
    worst = {key: rel_diff(trained["ours"][key], trained["frozen"][key]) for key in KEYS}
    worst["energy (numpy .dp)"] = rel_diff(trained["ours"]["energy"], trained["dp"]["energy"])
    print("mdtrain vs DeepPot (relative):", {k: f"{d:.1e}" for k, d in worst.items()})
    assert max(worst.values()) < 1e-10, worst
