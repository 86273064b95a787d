"""DOS and property training under a real address-space limit (``RLIMIT_AS`` in a child, as
`test_real_oom.py` does for the energy model): the allocation failures are recognised, the
batch is split, and the run ends with the unlimited run's lcurve.out byte for byte (the
property loss's sums and its displayed root of the loss add up over micro-batches)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.memory_limit import assert_recovers_from_real_oom
from tests.helpers.output_data import make_output_project

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs RLIMIT_AS, /proc"),
]


def heavy_project(root, kind: str):
    """The output project with wider nets and whole systems as batches (6 frames of 18
    atoms), so that a step needs several times the memory of one frame; 2 steps (rows at
    steps 1 and 2): every step runs the same allocations, so the limit
    cuts in the first and the rest would only repeat it; the property with
    DeePMD-kit's default metric, whose displayed ``rmse`` is the root of the summed loss."""
    inp = make_output_project(root, kind, numb_steps=2, numb_dos=32)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"].update(neuron=[16, 32, 64], axis_neuron=8, sel=[40, 80])
    config["model"]["fitting_net"]["neuron"] = [64, 64, 64]
    config["loss"].pop("metric", None)
    config["training"]["training_data"]["batch_size"] = 6
    config["training"]["validation_data"]["batch_size"] = 6
    config["training"].update(disp_freq=2, save_freq=1000, nlist_prefetch=0)
    inp.write_text(json.dumps(config))
    return inp


@pytest.mark.parametrize("kind", ["dos", "property"])
def test_output_training_recovers_from_real_allocation_failures(tmp_path, kind):
    assert_recovers_from_real_oom(heavy_project(tmp_path, kind), tmp_path)
