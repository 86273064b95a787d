"""A committee's fitting parameters kept stacked (``mdtrain.model.accel.stacked``): the
members' parameters are views of the stacks, their gradients and updates are exactly those
of stacking per call, a member's state holds its own values only, and parameters given
other data are stacked again."""

from __future__ import annotations

import torch

from mdtrain.model.accel.fitting_node import members_fitting_with_grad
from mdtrain.model.accel.layout import layer_params
from mdtrain.model.accel.stacked import StackedParams
from mdtrain.model.backend import build_committee
from mdtrain.model.committee import Committee, member_model_config
from mdtrain.model.fitting import EnergyFitting
from tests.helpers.models import batch, set_random_stats, small_config


def committee_for(size: int = 3) -> Committee:
    """A fused committee of ``size`` members of the small test model, statistics shared."""
    configs = [member_model_config(small_config(), k) for k in range(size)]
    committee = build_committee(configs, backend="fused")
    set_random_stats(committee.members[0])
    committee.share_statistics()
    return committee.train()


def loss_of(out: dict) -> torch.Tensor:
    return out["energy"].sum() + (out["force"] ** 2).sum() + (out["virial"] ** 2).sum()


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _fittings() -> list[EnergyFitting]:
    return [EnergyFitting(2, 12, [8, 8, 16], resnet_dt=True, seed=k) for k in range(3)]


def test_stacked_views_give_the_gradients_of_stacking_per_call():
    fittings = _fittings()
    atype = torch.tensor([0, 1, 1, 0, 1])
    descriptors = torch.randn(3, 2, 5, 12, dtype=torch.float64)

    def run(stacked) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        for f in fittings:
            f.zero_grad(set_to_none=True)
        views = (
            None if stacked is None else [s.views(p) for s, p in zip(stacked, params, strict=True)]
        )
        energy, grad = members_fitting_with_grad(fittings, descriptors, atype, views)
        ((energy**2).sum() + (grad**3).sum()).backward()
        return [energy, grad], [[p.grad.clone() for p in f.parameters()] for f in fittings]

    params = [[layer_params(f.networks[c].layers) for f in fittings] for c in (0, 1)]
    plain_out, plain_grads = run(None)
    stacked = [StackedParams(p) for p in params]
    for c, s in enumerate(stacked):  # every member parameter now lives in its stack
        for k, f in enumerate(fittings):
            for p, stack in zip(layer_params(f.networks[c].layers), s.stacks, strict=True):
                assert p.data_ptr() == stack[k].data_ptr()
    out, member_grads = run(stacked)
    for a, b in zip(out, plain_out, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(member_grads, plain_grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # an in-place update of a member parameter is an update of its stack
    p = fittings[1].networks[0].layers[0].weight
    with torch.no_grad():
        p.add_(1.0)
    torch.testing.assert_close(stacked[0].stacks[0][1], p.detach(), rtol=0, atol=0)


def test_a_member_state_holds_its_own_values_only():
    committee = committee_for()
    args = batch(committee.members[0], nmol=2)
    committee(*args)  # stacks the fitting parameters
    member = committee.members[1]
    weight = member.fitting.networks[0].layers[0].weight
    assert weight.untyped_storage().nbytes() == 3 * weight.numel() * weight.element_size()
    state = member.state_dict()  # torch.save writes every tensor's whole storage
    for key, value in state.items():
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), key
    assert torch.equal(state["fitting.networks.0.layers.0.weight"], weight.detach())


def test_parameters_given_other_data_are_stacked_again():
    """``load_state_dict(assign=True)`` replaces the members' tensors: the next forward
    stacks the new ones (each member again equals itself alone)."""
    committee = committee_for()
    args = batch(committee.members[0], nmol=2)
    committee(*args)
    donor = committee_for(size=1).members[0]
    committee.members[2].load_state_dict(donor.state_dict(), assign=True)
    outs = committee(*args)
    sum(loss_of(out) for out in outs).backward()
    together = grads(committee.members[2])
    weight = committee.members[2].fitting.networks[0].layers[0].weight
    assert weight.untyped_storage().nbytes() == 3 * weight.numel() * weight.element_size()
    committee.zero_grad()
    alone = committee.members[2](*args)
    loss_of(alone).backward()
    torch.testing.assert_close(outs[2]["energy"].detach(), alone["energy"].detach())
    for a, b in zip(grads(committee.members[2]), together, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * max(1.0, float(a.abs().max())))
