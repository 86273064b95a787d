"""Dipole and polar training under a real address-space limit (``RLIMIT_AS`` in a child, as
`test_real_oom.py` does for the energy model): the allocation failures are recognised, the
batch is split, and the run ends with the unlimited run's lcurve.out byte for byte."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.memory_limit import assert_recovers_from_real_oom
from tests.helpers.training import make_tensor_project

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs RLIMIT_AS, /proc"),
]


def heavy_project(root, kind: str):
    """The tensor project with wider nets and whole systems as batches (6 frames of 18 atoms),
    so that a step needs several times the memory of one frame. 2 steps (rows at steps 1 and
    2): every step runs the same allocations, so the limit cuts in the
    first and the rest would only repeat it."""
    inp = make_tensor_project(root, kind, numb_steps=2)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"].update(neuron=[16, 32, 64], axis_neuron=8, sel=[40, 80])
    config["model"]["fitting_net"]["neuron"] = [64, 64, 64]
    config["training"]["training_data"]["batch_size"] = 6
    config["training"]["validation_data"]["batch_size"] = 6
    config["training"].update(disp_freq=2, save_freq=1000, nlist_prefetch=0)
    inp.write_text(json.dumps(config))
    return inp


# polar shares the dipole's path through the controller: in the slow set only
@pytest.mark.parametrize("kind", ["dipole", pytest.param("polar", marks=pytest.mark.slow)])
def test_tensor_training_recovers_from_real_allocation_failures(tmp_path, kind):
    assert_recovers_from_real_oom(heavy_project(tmp_path, kind), tmp_path)
