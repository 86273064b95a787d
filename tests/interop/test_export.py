"""mdtrain's ``.dp`` export, evaluated by DeePMD-kit itself.

Every se_e2_a option the export covers gets a model with random weights and non-trivial
statistics (davg, dstd, energy bias), exported by ``mdtrain freeze CKPT -o model.dp``
(once as a real ``mdtrain`` process, otherwise the same command in this process), converted
by DeePMD-kit (``dp convert-backend model.dp model.pb``) and evaluated by its ``DeepPot``
(TensorFlow): energies, atom energies, forces and virials equal mdtrain's to 1e-10 of their
largest magnitude in float64 (float32 nets: 1e-5), on water frames, a triclinic cell
shorter than the cut-off and a non-periodic cluster. DeePMD's own ``.dp`` evaluator (its
numpy backend, energies only: its forces are NaN in 3.2.0) gives the same energies, and
mdtrain reading the file back gives the same numbers. One briefly trained model too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.infer.load import load_model
from mdtrain.model.deepmd_file import read_dp
from tests.helpers.datagen import random_water_like
from tests.helpers.deepmd import frames_npz, rel_diff
from tests.helpers.models import evaluate, make_model, save_tiny_checkpoint
from tests.helpers.processes import clean_env
from tests.helpers.training import make_project

pytestmark = pytest.mark.interop

KEYS = ("energy", "atom_energy", "force", "virial")
F32 = 1e-5  # float32 nets: rounding of single precision, not the format
# DeePMD-kit's TensorFlow "gelu_tf" is tf.nn.gelu(approximate=True), ~1e-9 from the tanh
# formula in float64 (its "gelu", a custom operator, and the numpy backend are exact)
GELU_TF = 1e-8
TF_NO_ENV_PROTECTION = "TensorFlow backend refuses env_protection != 0 (NotImplementedError)"
TF_NO_ATOM_EXCLUSION = (
    "convert-backend to .pb drops atom_exclude_types for energy models (excluded atoms get "
    "energies): compared with DeePMD's numpy .dp evaluator only"
)
TF_NO_CONCAT_SKIP = (
    "TensorFlow's fitting nets have no skip connection into a layer twice as wide as the one "
    "before (the numpy and PyTorch backends concatenate the input with itself there)"
)
TF_EXCLUSION_PADDING = (
    "TensorFlow zeroes the empty neighbour slots of an excluded type pair; DeePMD's numpy and "
    "PyTorch backends (and mdtrain) keep their -davg/dstd entries: the backends agree only "
    "where davg is 0 in excluded blocks (the *_tf cases)"
)


@dataclass(frozen=True)
class Case:
    """An exported model: settings on top of BASE in tests/helpers/models.py (rcut 3.5, sel
    [12, 24], nets [4, 8, 16] / [16, 16], type_one_side, resnet_dt); ``tf`` None when the
    TensorFlow ``.pb`` must agree on everything, else why it cannot (the numpy ``.dp``
    evaluator's energies must agree either way); ``zero_excluded_davg``: davg 0 in the
    blocks of excluded type pairs."""

    descriptor: dict = field(default_factory=dict)
    fitting: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    tf: str | None = None
    zero_excluded_davg: bool = False


EXCLUDE_ONE = {"exclude_types": [[1, 1]]}
EXCLUDE_TWO = {"type_one_side": False, "exclude_types": [[0, 1]]}
CASES: dict[str, Case] = {
    "one_side": Case(),
    "two_side": Case({"type_one_side": False}),
    "no_resnet_dt": Case({"type_one_side": False, "resnet_dt": False}, {"resnet_dt": False}),
    "exclude_types_one_side_tf": Case(EXCLUDE_ONE, zero_excluded_davg=True),
    "exclude_types_two_side_tf": Case(EXCLUDE_TWO, zero_excluded_davg=True),
    "exclude_types_one_side": Case(EXCLUDE_ONE, tf=TF_EXCLUSION_PADDING),
    "exclude_types_two_side": Case(EXCLUDE_TWO, tf=TF_EXCLUSION_PADDING),
    "atom_exclude_types": Case(model={"atom_exclude_types": [1]}, tf=TF_NO_ATOM_EXCLUSION),
    "env_protection": Case(
        {"env_protection": 0.05, "type_one_side": False}, tf=TF_NO_ENV_PROTECTION
    ),
    "set_davg_zero": Case({"set_davg_zero": True}),
    "float32": Case({"precision": "float32"}, {"precision": "float32"}),
    "float32_descriptor": Case({"precision": "float32", "type_one_side": False}),
    "float32_fitting": Case(fitting={"precision": "float32"}),
    "gelu_softplus": Case({"activation_function": "gelu"}, {"activation_function": "softplus"}),
    "sigmoid_silu": Case({"activation_function": "sigmoid"}, {"activation_function": "silu"}),
    "relu6_gelu_tf": Case(
        {"activation_function": "relu6", "type_one_side": False}, {"activation_function": "gelu_tf"}
    ),
    "relu_linear": Case({"activation_function": "relu"}, {"activation_function": "linear"}),
    # descriptor width 16 x axis 4 = 64 -> fitting 128: a doubling layer
    "fitting_doubles": Case(fitting={"neuron": [128, 128]}, tf=TF_NO_CONCAT_SKIP),
}
TRAINED = "trained"  # `mdtrain train`, 4 steps: tanh, float64, type_one_side


def tolerance(name: str, dp_file: Path) -> float:
    """1e-10, or looser for float32 nets and for nets TensorFlow runs with tf.nn.gelu."""
    if name.startswith("float32"):
        return F32
    text = json.dumps(read_dp(dp_file)["model"], default=str)
    return GELU_TF if '"gelu_tf"' in text else 1e-10


def build(case: Case) -> torch.nn.Module:
    """The case's model; an energy std other than 1, as training leaves it (unused by the
    energy, but DeePMD-kit's TensorFlow backend would scale atom energies by it)."""
    model = make_model(case.descriptor, case.fitting, **case.model).eval()
    model.set_out_bias(model.out_bias.clone(), std=[0.7, 0.4])
    if case.zero_excluded_davg:
        desc = model.descriptor
        davg = desc.davg.clone()
        edges = np.cumsum([0, *desc.sel])
        for a, b in desc.exclude_types:
            for centre, neighbour in ((a, b), (b, a)):
                davg[centre, edges[neighbour] : edges[neighbour + 1]] = 0.0
        desc.set_stats(davg, desc.dstd.clone())
    return model


def frame_groups() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """(coord (nf, N, 3), atype (N,) in O H H order, box (nf, 3, 3) or None) per group."""
    water, types, boxes = random_water_like(2, 8, 6.4, seed=21)
    tri, tri_types, tri_boxes = random_water_like(2, 1, 3.3, seed=22, triclinic=True)
    cluster, cluster_types, _ = random_water_like(2, 4, 6.0, seed=23)
    return {
        "water": (water, types, boxes),
        "triclinic": (tri, tri_types, tri_boxes),  # 3.3 Å cell, rcut 3.5 (4 when trained)
        "cluster": (cluster, cluster_types, None),
    }


def ours(model, coord, atype, box) -> dict[str, np.ndarray]:
    out = [evaluate(model, c, None if box is None else box[f], atype) for f, c in enumerate(coord)]
    return {k: np.stack([o[k] for o in out]) for k in KEYS}


def trained_checkpoint(tmp) -> str:
    """A few steps of ``mdtrain train`` on generated water data (the training tests' project)."""
    project = make_project(tmp, numb_steps=4, save_freq=4)
    proc = subprocess.run(
        [sys.executable, "-m", "mdtrain", "train", str(project)],
        cwd=tmp,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(tmp / "model.ckpt.pt")


@pytest.fixture(scope="module")
def results(deepmd, tmp_path_factory) -> dict:
    """name -> group -> {"ours", "pb", "dp", "reread"} outputs, one DeePMD-kit run for all."""
    tmp = tmp_path_factory.mktemp("export")
    groups = frame_groups()
    for group, (coord, atype, box) in groups.items():
        frames_npz(tmp / f"{group}.npz", coord, atype, box)
    models = {}
    for name, case in CASES.items():
        models[name] = build(case)
        save_tiny_checkpoint(tmp / f"{name}.pt", models[name])
    checkpoints = {name: str(tmp / f"{name}.pt") for name in CASES}
    checkpoints[TRAINED] = trained_checkpoint(tmp / TRAINED)
    models[TRAINED] = load_model(checkpoints[TRAINED])
    job: dict = {"convert": [], "evaluate": []}
    for name, checkpoint in checkpoints.items():
        out = tmp / f"{name}.dp"
        if name == "one_side":  # the command itself, in a process of its own
            subprocess.run(
                [sys.executable, "-m", "mdtrain", "freeze", checkpoint, "-o", str(out)],
                check=True,
                env=clean_env(),
                capture_output=True,
            )
        else:
            assert main(["freeze", checkpoint, "-o", str(out)]) == 0
        job["convert"].append([f"{name}.dp", f"{name}.pb"])
        for group in groups:
            for kind in ("pb", "dp"):
                job["evaluate"].append(
                    {
                        "model": f"{name}.{kind}",
                        "frames": f"{group}.npz",
                        "out": f"{name}-{group}-{kind}.npz",
                    }
                )
    errors = deepmd.driver(job, tmp)
    found: dict = {"errors": errors, "dir": tmp}
    for name, model in models.items():
        reread = load_model(tmp / f"{name}.dp")
        for group, (coord, atype, box) in groups.items():
            found.setdefault(name, {})[group] = {
                "ours": ours(model, coord, atype, box),
                "reread": ours(reread, coord, atype, box),
                **{
                    kind: dict(np.load(path)) if path.exists() else None
                    for kind in ("pb", "dp")
                    for path in [tmp / f"{name}-{group}-{kind}.npz"]
                },
            }
    return found


@pytest.mark.parametrize("name", [*CASES, TRAINED])
def test_deepmd_evaluates_the_export_as_mdtrain(results, name):
    """DeepPot (TensorFlow, after ``dp convert-backend``) on every quantity where TensorFlow
    has the setting; DeePMD's numpy ``.dp`` evaluator on energies and atom energies; mdtrain
    reading the file back on every quantity."""
    case = CASES.get(name, Case())
    tol = tolerance(name, results["dir"] / f"{name}.dp")
    worst: dict[str, float] = {}
    for group, found in results[name].items():
        assert found["dp"] is not None, results["errors"].get(f"{name}-{group}-dp.npz")
        for key in KEYS:
            worst[f"{group}/{key}/reread"] = rel_diff(found["reread"][key], found["ours"][key])
        for key in ("energy", "atom_energy"):
            worst[f"{group}/{key}/dp"] = rel_diff(found["dp"][key], found["ours"][key])
        if case.tf is None:
            assert found["pb"] is not None, results["errors"].get(f"{name}-{group}-pb.npz")
            for key in KEYS:
                worst[f"{group}/{key}/pb"] = rel_diff(found["pb"][key], found["ours"][key])
        elif found["pb"] is not None:  # shown, not asserted: DeePMD-kit's backends differ
            tf_energy = rel_diff(found["pb"]["energy"], found["ours"]["energy"])
            print(f"{name} {group}: TensorFlow energy differs by {tf_energy:.1e} ({case.tf})")
    if case.tf == TF_NO_ENV_PROTECTION:
        assert "env_protection" in results["errors"].get(f"{name}.pb", "")
    print(name, f"tol {tol:g}", json.dumps({k: f"{v:.1e}" for k, v in worst.items()}))
    bad = {k: v for k, v in worst.items() if not v < tol}
    assert not bad, f"{name}: relative differences above {tol:g}: {bad}"
