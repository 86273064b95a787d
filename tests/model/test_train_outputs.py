"""What a training step of the explicit model skips or keeps when it need not redo it: the
virial when the loss does not read it (``ExplicitEnergyModel.train_outputs``, said once by the
trainer), and davg/dstd in the model's dtype with the padded row −davg/dstd kept across steps
(``environment_node.normalisation``). Both must give the same bits as before."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from mdtrain.model.accel.environment_node import normalisation
from mdtrain.model.accel.force_node import forces_and_virial
from mdtrain.model.backend import build_model
from mdtrain.train.loss import EnergyLoss
from tests.helpers.models import batch, set_random_stats, small_config

COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
BACKENDS = ["fused", pytest.param("kernels", marks=pytest.mark.skipif(not COMPILER, reason="no C++ compiler"))]  # fmt: skip


def _model(backend: str, precision: str, seed: int = 0):
    config = small_config({"sel": [8, 13]})
    config["descriptor"]["precision"] = config["fitting_net"]["precision"] = precision
    torch.manual_seed(seed)
    return set_random_stats(build_model(config, backend=backend), seed=seed)


def _step(model, inputs):
    """A training forward and the parameter gradients of an energy + force loss."""
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(out["force"].shape, generator=gen, dtype=out["force"].dtype)
    ((out["energy"] ** 2).sum() + (out["force"] * w).sum()).backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_training_without_the_virial_gives_the_same_bits(backend, precision):
    model = _model(backend, precision)
    inputs = batch(model, True)
    full, grads = _step(model, inputs)
    assert "virial" in full
    model.train_outputs({"energy", "force"})
    part, part_grads = _step(model, inputs)
    assert "virial" not in part
    for key in ("energy", "atom_energy", "force"):
        assert torch.equal(full[key], part[key])
    assert all(torch.equal(a, b) for a, b in zip(grads, part_grads, strict=True))
    # evaluation still returns every output, the virial as before
    model.eval()
    assert torch.equal(model(*inputs)["virial"], full["virial"].detach())
    model.train()
    with torch.no_grad():
        assert torch.equal(model(*inputs)["virial"], full["virial"].detach())
    model.train_outputs({"energy", "force", "virial"})
    again, _ = _step(model, inputs)
    assert torch.equal(again["virial"], full["virial"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_force_node_without_the_virial(backend):
    model = _model(backend, "float64")
    coord, atype, box, nlist, shift = batch(model, True)
    diff = model.pair_vectors(coord, box, nlist, shift)
    env = model.form.environment(model.descriptor, diff, nlist, atype)
    _, rbar = model.energy_and_row_grad(env, atype)
    pieces = [p.detach().requires_grad_(True) for p in rbar]
    force, virial = forces_and_virial(env.force, pieces)
    force_only, none = forces_and_virial(env.force, pieces, virial=False)
    assert none is None and virial is not None and torch.equal(force, force_only)
    w = torch.randn(force.shape, dtype=force.dtype, generator=torch.Generator().manual_seed(1))
    a = torch.autograd.grad((force * w).sum(), pieces)
    b = torch.autograd.grad((force_only * w).sum(), pieces)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_loss_reads_the_outputs_of_its_terms():
    water = EnergyLoss(0.02, 1.0, 1000.0, 1.0, 0.0, 0.0, start_lr=1e-3)
    assert water.reads() == {"energy", "force"}
    # one zero prefactor switches a term off (DeePMD-kit's PyTorch backend): no virial read
    assert "virial" not in EnergyLoss(0.02, 1, 1000, 1, 0.0, 1.0, start_lr=1e-3).reads()
    assert "virial" in EnergyLoss(0.02, 1, 1000, 1, 0.5, 1.0, start_lr=1e-3).reads()
    ae = EnergyLoss(0, 0, 0, 0, 0, 0, start_lr=1e-3, extra_prefs={"atom_ener": (1.0, 1.0)})
    assert ae.reads() == {"energy", "atom_energy"}


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_normalisation_follows_the_statistics(precision):
    model = _model("fused", precision)
    desc, dtype = model.descriptor, getattr(torch, precision)

    def plain():
        return desc.davg.to(dtype), desc.dstd.to(dtype), -desc.davg.to(dtype) / desc.dstd.to(dtype)

    kept = normalisation(desc)
    assert normalisation(desc) is kept  # the same step after step
    for a, b in zip(kept[:3], plain(), strict=True):
        assert a.dtype == dtype and a.is_contiguous() and torch.equal(a, b)
    with torch.no_grad():  # statistics set in place (the version changes)
        desc.dstd.mul_(1.5)
    changed = normalisation(desc)
    assert changed is not kept
    assert all(torch.equal(a, b) for a, b in zip(changed[:3], plain(), strict=True))
    other = _model("fused", precision, seed=4)
    model.load_state_dict(other.state_dict())  # a checkpoint loaded
    loaded = normalisation(desc)
    assert torch.equal(
        loaded.pad, -other.descriptor.davg.to(dtype) / other.descriptor.dstd.to(dtype)
    )
    desc.davg = desc.davg.clone() + 0.25  # new tensors
    assert torch.equal(normalisation(desc).davg, desc.davg.to(dtype))


def test_normalisation_made_in_inference_serves_training():
    model = _model("fused", "float32")
    inputs = batch(model, True)
    with torch.inference_mode():
        model.eval()
        model(*inputs)
        model.train()
    assert not normalisation(model.descriptor).pad.is_inference()
    _step(model, inputs)  # the kept values may be saved for a backward
