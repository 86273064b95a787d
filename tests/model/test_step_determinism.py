"""Run-to-run determinism of a float32 training step on two threads (fused, kernels).

Two backward passes on the same inputs must give bit-identical parameter gradients, or two
training runs of the same input drift apart (a float32 run on main differed in 84 of 133
checkpoint tensors after 30 steps). Run in a subprocess so that its thread count is its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_COMPILER = shutil.which(os.environ.get("CXX", "c++"))
needs_kernels = pytest.mark.skipif(_COMPILER is None, reason="no C++ compiler")

# Wide enough (B·4·M >= 32768 elements: 120 centres, M = 100) that torch's parallel paths
# for float32 (e.g. index_put_ with accumulate=True, atomic adds) are taken on two threads.
_SCRIPT = """
import json, sys, torch
torch.set_num_threads(2)
from mdtrain.model.backend import build_model
from tests.helpers.models import set_random_stats, small_config, water_like
from mdtrain.neighbors.layout import layout_of
import numpy as np

desc = {"neuron": [4, 8, 100], "precision": "float32", **json.loads(sys.argv[2])}
model = build_model(small_config(desc, {"precision": "float32"}), backend=sys.argv[1])
set_random_stats(model)
box = np.eye(3) * 11.0
coord, atype = water_like(40, box, seed=3)
nlist, shift, _ = layout_of(model).build(coord, box, atype, model.rcut, model.sel)
inputs = (torch.tensor(coord)[None], torch.tensor(atype), torch.tensor(box)[None],
          torch.tensor(nlist)[None], torch.tensor(shift)[None])

def grads():
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    (out["energy"].sum() + (out["force"] ** 2).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

first = grads()
differ = set()
for _ in range(6):
    again = grads()
    differ |= {n for n in first if not torch.equal(first[n], again[n])}
print(json.dumps({"grads": len(first), "differ": sorted(differ)}))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["fused", pytest.param("kernels", marks=needs_kernels)])
def test_float32_two_thread_gradients_are_bitwise_repeatable(backend):
    _assert_repeatable(backend, {})


# the type-mixed descriptors gather type embeddings (and the strip net's table) per slot: 120
# centres x 40 slots x 8 columns, past the 32768 elements of torch's parallel path
_ATTEN = {"sel": 40, "rcut": 3.5, "rcut_smth": 0.5, "neuron": [4, 8], "axis_neuron": 2}
_ATTEN |= {"tebd_dim": 3, "attn": 6, "attn_layer": 1, "seed": 1}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "descriptor",
    [
        {"type": "se_atten_v2", **_ATTEN},
        {"type": "se_atten_v2", **_ATTEN, "type_one_side": True},
    ],
    ids=["se_atten_v2", "se_atten_v2-one-side"],
)
def test_float32_two_thread_gradients_of_type_mixed_descriptors_are_repeatable(descriptor):
    _assert_repeatable("reference", descriptor)


def _assert_repeatable(backend: str, descriptor: dict) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, backend, json.dumps(descriptor)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["grads"] > 0
    assert report["differ"] == []
