"""The learning-rate schedules against DeePMD-kit 3.2.0's PyTorch backend: ``dp --pt train``
and ``mdtrain train`` on the same input (200 steps, a row every step) write the same ``lr``
column in lcurve.out for ``exp``, ``exp`` with ``smooth``, ``cosine`` and ``wsd``, each with a
warm-up; and mdtrain's schedule equals, at every step, the learning rate DeePMD-kit's trainer
hands its optimiser (``LambdaLR``: ``start_lr * value(step) / start_lr``) to a few ulp.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.train.lr import make_schedule
from tests.helpers.datagen import water_labeled, write_npy_system
from tests.helpers.deepmd import deepmd_input

pytestmark = pytest.mark.interop

STEPS = 200
SCHEDULES = {
    "exp": {"type": "exp", "start_lr": 3e-3, "stop_lr": 3e-5, "decay_steps": 20, "warmup_steps": 30},
    "exp_smooth": {"type": "exp", "start_lr": 3e-3, "stop_lr": 3e-5, "decay_steps": 20,
                   "smooth": True, "warmup_ratio": 0.15, "warmup_start_factor": 0.1},
    "cosine": {"type": "cosine", "start_lr": 3e-3, "stop_lr": 1e-5, "warmup_steps": 25,
               "warmup_start_factor": 0.05},
    "wsd": {"type": "wsd", "start_lr": 3e-3, "stop_lr": 1e-5, "warmup_steps": 20,
            "decay_phase_ratio": 0.3, "decay_type": "inverse_linear"},
}  # fmt: skip

DEEPMD_VALUES = """
import json, sys
from deepmd.dpmodel.utils.learning_rate import BaseLR
params = json.loads(sys.argv[1])
lr = BaseLR(**params, num_steps={steps})
base = float(lr.start_lr)
print(json.dumps([base * (lr.value(s) / base) for s in range({steps})]))
"""


def lr_column(path) -> tuple[list[int], list[str]]:
    with open(path) as handle:
        rows = [ln.split() for ln in handle if not ln.startswith("#")]
    return [int(r[0]) for r in rows], [r[-1] for r in rows]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lr_data")
    write_npy_system(root / "data", **water_labeled(6, seed=11))
    return root


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_lr_column_equals_deepmd(name, deepmd_pt, data_dir, tmp_path):
    config = deepmd_input(systems=[str(data_dir / "data")])
    config["learning_rate"] = dict(SCHEDULES[name])
    config["training"].update(numb_steps=STEPS, disp_freq=1, save_freq=STEPS)
    dp_dir, md_dir = tmp_path / "dp", tmp_path / "md"
    dp_dir.mkdir()
    (dp_dir / "input.json").write_text(json.dumps(config, indent=1))
    deepmd_pt.dp_cmd(["--pt", "train", "input.json"], dp_dir, timeout=1200)
    md_dir.mkdir()
    (md_dir / "input.json").write_text(json.dumps(config, indent=1))
    assert main(["train", str(md_dir / "input.json"), "-o", str(md_dir / "out")]) == 0
    dp_steps, dp_lr = lr_column(dp_dir / "lcurve.out")
    md_steps, md_lr = lr_column(md_dir / "out" / "lcurve.out")
    assert dp_steps == md_steps == list(range(1, STEPS + 1))
    assert md_lr == dp_lr  # the printed column (%8.1e), character for character
    # full precision: DeePMD-kit's values through its LambdaLR, step by step
    script = DEEPMD_VALUES.format(steps=STEPS)
    out = deepmd_pt.run([deepmd_pt.python, "-c", script, json.dumps(SCHEDULES[name])], tmp_path)
    theirs = np.array(json.loads(out.strip().splitlines()[-1]))
    ours = np.array([make_schedule(SCHEDULES[name], STEPS).value(s) for s in range(STEPS)])
    # relative to DeePMD-kit's value (the warm-up may start at 0: there the difference itself)
    rel = np.abs(ours - theirs) / np.where(theirs == 0, 1.0, theirs)
    printed = max(abs(float(a) - float(b)) for a, b in zip(md_lr, dp_lr, strict=True))
    print(f"{name}: largest relative difference {rel.max():.2e}, printed column {printed:.1e}")
    assert rel.max() < 8 * math.ulp(1.0)


@pytest.mark.parametrize(
    "auto_prob", ["prob_sys_size", "prob_uniform", "prob_sys_size;0:1:0.3;1:3:0.7"]
)
def test_numb_epoch_gives_deepmd_steps(auto_prob, deepmd_pt, tmp_path):
    """``numb_epoch`` becomes the number of steps ``dp --pt train`` computes (three systems of
    7, 10 and 5 frames, batch sizes 2, 3 and 1)."""
    systems = []
    for k, nframes in enumerate((7, 10, 5)):
        systems.append(
            str(write_npy_system(tmp_path / f"sys{k}", **water_labeled(nframes, seed=k)))
        )
    config = deepmd_input(systems=systems)
    training = config["training"]
    del training["numb_steps"]
    training.update(numb_epoch=1.7, disp_freq=1, save_freq=1000)
    training["training_data"].update(batch_size=[2, 3, 1], auto_prob=auto_prob)
    (tmp_path / "input.json").write_text(json.dumps(config, indent=1))
    log = deepmd_pt.dp_cmd(["--pt", "train", "input.json"], tmp_path, timeout=1200)
    computed = [int(v) for v in re.findall(r"Computed num_steps=(\d+)", log)]
    assert len(computed) == 1
    assert main(["train", str(tmp_path / "input.json"), "-o", str(tmp_path / "md")]) == 0
    steps, _ = lr_column(tmp_path / "md" / "lcurve.out")
    print(f"{auto_prob}: {computed[0]} steps")
    assert steps[-1] == computed[0]
