"""mdtrain's AdaMuon and HybridMuon against DeePMD-kit 3.2.0's own optimisers
(``deepmd.pt.optimizer``): the same named float64 parameters (matrices square and
rectangular, a 3-d tensor, biases, a vector-like matrix, an ``adamw_`` parameter) and the same
gradients for 4 steps; the parameters after each step are the same, to the last bit where
DeePMD-kit's Gram Newton-Schulz iteration runs as written (eager) and within a few percent of
the step where it runs compiled by ``torch.compile``, whose float16 rounding differs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mdtrain.train.hybrid_muon import HybridMuon
from mdtrain.train.muon import AdaMuon

pytestmark = pytest.mark.interop

SHAPES = {
    "net.0.matrix": (8, 16), "net.0.bias": (16,), "net.1.matrix": (16, 16),
    "net.1.idt": (16,), "net.2.matrix": (16, 1), "tall.weight": (24, 6),
    "cube.weight": (3, 4, 5), "scale.adamw_gain": (4, 4),
    # rectangular matrices sharing their smaller side: one padded Gram iteration
    "wide.weight": (6, 12), "wide2.weight": (12, 8), "w3.weight": (8, 20),
}  # fmt: skip
STEPS = 4

DEEPMD_SIDE = """
import json, sys
import numpy as np, torch
from deepmd.pt.optimizer import AdaMuonOptimizer, HybridMuonOptimizer
from deepmd.pt.optimizer.hybrid_muon import _GramNewtonSchulzOrthogonalizer
arrays = np.load(sys.argv[1])
settings = json.loads(sys.argv[2])
names = [n for n in arrays.files if not n.startswith("grad")]
params = [torch.nn.Parameter(torch.from_numpy(arrays[n].copy())) for n in names]
kind = settings.pop("type")
if kind == "AdaMuon":
    opt = AdaMuonOptimizer(params, **settings)
else:
    eager = settings.pop("eager", False)
    opt = HybridMuonOptimizer(params, flash_muon=False, **settings)
    opt.set_param_names(list(zip(names, params)))
    if eager:  # the Gram iteration without torch.compile (its arithmetic as written)
        gram = _GramNewtonSchulzOrthogonalizer()
        gram._compiled_call = gram._orthogonalize_impl
        opt._gram_orthogonalizer = gram
out = {}
for step in range(int(sys.argv[3])):
    for n, p in zip(names, params):
        p.grad = torch.from_numpy(arrays[f"grad{step}/{n}"].copy())
    opt.step()
    for n, p in zip(names, params):
        out[f"{step}/{n}"] = p.detach().numpy().copy()
np.savez(sys.argv[4], **out)
"""

CASES = {
    "AdaMuon": {"type": "AdaMuon", "lr": 0.01},
    "AdaMuon-rms": {"type": "AdaMuon", "lr": 0.01, "lr_adjust": 0.0},
    "HybridMuon": {"type": "HybridMuon", "lr": 0.01, "eager": True},
    "HybridMuon-compiled": {"type": "HybridMuon", "lr": 0.01},
    "HybridMuon-plain": {"type": "HybridMuon", "lr": 0.01, "enable_gram": False,
                         "magma_muon": False, "muon_mode": "flat", "lr_adjust": 4.0},
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_muon_steps_equal_deepmd(case, deepmd_pt, tmp_path):
    rng = np.random.default_rng(5)
    arrays = {n: rng.normal(size=s) for n, s in SHAPES.items()}
    for step in range(STEPS):
        arrays.update({f"grad{step}/{n}": rng.normal(size=s) for n, s in SHAPES.items()})
    np.savez(tmp_path / "in.npz", **arrays)
    settings = dict(CASES[case])
    deepmd_pt.run(
        [deepmd_pt.python, "-c", DEEPMD_SIDE, tmp_path / "in.npz", json.dumps(settings),
         str(STEPS), tmp_path / "out.npz"],
        tmp_path,
    )  # fmt: skip
    theirs = np.load(tmp_path / "out.npz")
    named = [(n, torch.nn.Parameter(torch.from_numpy(arrays[n].copy()))) for n in SHAPES]
    kind = settings.pop("type")
    compiled = kind == "HybridMuon" and not settings.pop("eager", False)
    if kind == "AdaMuon":
        opt = AdaMuon([p for _, p in named], **settings)
    else:
        opt = HybridMuon(named, **settings)
    worst = 0.0
    for step in range(STEPS):
        for n, p in named:
            p.grad = torch.from_numpy(arrays[f"grad{step}/{n}"].copy())
        opt.step()
        for n, p in named:
            ref = theirs[f"{step}/{n}"]
            change = np.abs(ref - arrays[n]).max()  # how far DeePMD-kit moved it
            diff = np.abs(p.detach().numpy() - ref).max()
            worst = max(worst, diff / change)
    print(f"{case}: largest difference relative to the parameters' change {worst:.1e}")
    # DeePMD-kit compiles the float16 Gram iteration (torch.compile), which rounds otherwise
    assert worst < (0.05 if compiled else 1e-12)
