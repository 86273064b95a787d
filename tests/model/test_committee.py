"""The committee model (``build_committee``): on every backend each member's outputs and
parameter gradients equal the plain reference model's with the member's weights, and the
accelerated committee (environment computed once, fitting nets batched) equals each member
evaluated alone by its own accelerated forward."""

from __future__ import annotations

import pytest
import torch

from mdtrain.model.accel.committee import ExplicitCommittee
from mdtrain.model.accel.fitting_node import fitting_with_grad, members_fitting_with_grad
from mdtrain.model.accel.kernels import load_kernels
from mdtrain.model.backend import as_reference, build_committee
from mdtrain.model.committee import Committee, member_model_config
from mdtrain.model.fitting import EnergyFitting
from tests.helpers.models import batch, set_random_stats, small_config


def _kernels_available() -> bool:
    try:
        load_kernels()
    except RuntimeError:
        return False
    return True


BACKENDS = ["reference", "fused", pytest.param("kernels", marks=pytest.mark.skipif(
    not _kernels_available(), reason="no C++ compiler for the kernels"))]  # fmt: skip


def committee_for(backend: str, size: int = 3, **descriptor) -> Committee:
    base = small_config(descriptor)
    committee = build_committee(
        [member_model_config(base, k) for k in range(size)], backend=backend
    )
    set_random_stats(committee.members[0])
    committee.share_statistics()
    return committee.train()


def loss_of(out: dict) -> torch.Tensor:
    return (
        out["energy"].sum()
        + (out["force"] ** 2).sum()
        + (out["virial"] ** 2).sum()
        + (out["atom_energy"] ** 2).sum()
    )


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_member_configs_differ_in_seeds_only():
    base = small_config()
    member = member_model_config(base, 2)
    assert member["descriptor"]["seed"] == base["descriptor"]["seed"] + 2
    assert member["fitting_net"]["seed"] == base["fitting_net"]["seed"] + 2
    member["descriptor"]["seed"] = base["descriptor"]["seed"]
    member["fitting_net"]["seed"] = base["fitting_net"]["seed"]
    assert member == base
    assert (
        member_model_config({**base, "descriptor": {**base["descriptor"], "seed": None}}, 1)[
            "descriptor"
        ]["seed"]
        is None
    )


@pytest.mark.parametrize("type_one_side", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_committee_equals_reference_members(backend, type_one_side):
    committee = committee_for(backend, type_one_side=type_one_side)
    assert committee.backend == backend
    assert isinstance(committee, ExplicitCommittee) == (backend != "reference")
    assert committee.stats_shared()
    args = batch(committee.members[0], nmol=4)
    outs = committee(*args)
    sum(loss_of(out) for out in outs).backward()
    for member, out in zip(committee.members, outs, strict=True):
        reference = as_reference(member)
        if reference is member:  # the reference backend: a separate copy to compare with
            reference = type(member)(member.get_model_config())
            reference.load_state_dict(member.state_dict())
        reference.train()
        alone = reference(*args)
        loss_of(alone).backward()
        for key in alone:
            torch.testing.assert_close(
                out[key].detach(), alone[key].detach(), rtol=1e-10, atol=1e-10
            )
        for a, b in zip(grads(member), grads(reference), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9 * max(1.0, float(b.abs().max())))
    # the members differ (so each one's comparison is its own)
    assert not torch.allclose(outs[0]["energy"], outs[1]["energy"])


@pytest.mark.parametrize("type_one_side", [True, False])
@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_shared_work_equals_members_alone(backend, type_one_side):
    """The accelerated committee against each member's own accelerated forward: the shared
    environment is exact; batched fitting products round like single ones to ~1e-16."""
    committee = committee_for(backend, type_one_side=type_one_side)
    args = batch(committee.members[0], nmol=4)
    outs = committee(*args)
    sum(loss_of(out) for out in outs).backward()
    together = [grads(m) for m in committee.members]
    committee.zero_grad()
    for k, member in enumerate(committee.members):
        alone = member(*args)
        loss_of(alone).backward()
        for key in alone:
            torch.testing.assert_close(
                outs[k][key].detach(), alone[key].detach(), rtol=1e-13, atol=1e-13
            )
        for a, b in zip(grads(member), together[k], strict=True):
            torch.testing.assert_close(
                a, b, rtol=1e-12, atol=1e-12 * max(1.0, float(a.abs().max()))
            )


def test_members_fitting_equals_each_fitting():
    fittings = [EnergyFitting(2, 12, [8, 8, 16], resnet_dt=True, seed=k) for k in range(3)]
    atype = torch.tensor([0, 1, 1, 0, 1])
    descriptors = torch.randn(3, 2, 5, 12, dtype=torch.float64, requires_grad=True)
    energy, grad = members_fitting_with_grad(fittings, descriptors, atype)
    ((energy**2).sum() + (grad**3).sum()).backward()
    batched = [[p.grad.clone() for p in f.parameters()] for f in fittings]
    input_grad = descriptors.grad.clone()
    for k, fitting in enumerate(fittings):
        fitting.zero_grad()
        d = descriptors.detach()[k].clone().requires_grad_(True)
        e_k, g_k = fitting_with_grad(fitting, d, atype)
        ((e_k**2).sum() + (g_k**3).sum()).backward()
        torch.testing.assert_close(energy[k], e_k, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(grad[k], g_k, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(input_grad[k], d.grad, rtol=1e-13, atol=1e-13)
        for a, b in zip(batched[k], fitting.parameters(), strict=True):
            torch.testing.assert_close(a, b.grad, rtol=1e-13, atol=1e-13)


def test_evaluation_builds_no_graph():
    committee = committee_for("fused").eval()
    outs = committee(*batch(committee.members[0], nmol=2))
    assert all(v.grad_fn is None for out in outs for v in out.values())


def test_different_statistics_are_detected():
    committee = committee_for("fused")
    with torch.no_grad():
        committee.members[1].descriptor.dstd.mul_(2.0)
    assert not committee.stats_shared()
