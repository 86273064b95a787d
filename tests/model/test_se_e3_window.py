"""The three-body sums over the real slots only against the plain sums over every pair of
slots: se_e3's windowed, symmetric sum (``DescriptorSeT``) against ``DescriptorSeTPadded``,
and se_e3_tebd's sum over the pairs of real slots (``DescriptorSeE3Tebd``) against
``DescriptorSeE3TebdPadded``: energies, forces, virials and the training gradients of an
energy + force loss, float64, to 1e-12."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mdtrain.model import EnergyModel
from mdtrain.model.descriptors.se_e3 import DescriptorSeT, DescriptorSeTPadded
from mdtrain.model.descriptors.se_e3_tebd import DescriptorSeE3Tebd, DescriptorSeE3TebdPadded
from tests.helpers.descriptor_battery import battery_config
from tests.helpers.models import batch, set_random_stats, small_config

SE_E3 = {"type": "se_e3", "sel": [10, 20], "neuron": [2, 4, 8], "seed": 3}
TEBD = {"sel": 30, "rcut": 3.5, "neuron": [2, 4, 8], "tebd_dim": 4}
# the fast class and the plain one of each kind
CLASSES = {"se_e3": (DescriptorSeT, DescriptorSeTPadded)}
CLASSES["se_e3_tebd"] = (DescriptorSeE3Tebd, DescriptorSeE3TebdPadded)


def pair(kind: str = "se_e3", descriptor: dict | None = None, angular_davg: bool = False):
    """The same model with the sum over real slots and with the plain one."""
    if kind == "se_e3":
        cfg = small_config({**SE_E3, **(descriptor or {})})
        for key in ("axis_neuron", "type_one_side"):  # se_e2_a's keys, not se_e3's
            del cfg["descriptor"][key]
    else:
        cfg = battery_config("se_e3_tebd", {**TEBD, **(descriptor or {})})
    fast = set_random_stats(EnergyModel(cfg))
    if angular_davg:  # padded rows nonzero: every slot must enter
        with torch.no_grad():
            fast.descriptor.davg[:, :, 1:] += 0.05
    assert type(fast.descriptor) is CLASSES[kind][0]
    plain = copy.deepcopy(fast)
    plain.descriptor.__class__ = CLASSES[kind][1]
    return fast, plain


def assert_same(got: list, want: list) -> None:
    """Each tensor to 1e-12 relative to its norm (the terms are summed in another order)."""
    assert len(got) == len(want) > 3
    for a, b in zip(got, want):
        assert float(torch.linalg.vector_norm(a - b)) <= 1e-12 * float(torch.linalg.vector_norm(b))


def outputs_and_grads(model, inputs):
    """Energy, force, virial and the parameter gradients of an E + F loss."""
    model.train()
    model.zero_grad()
    out = model(*inputs)
    loss = (out["energy"] ** 2).sum() + (out["force"] ** 2).sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [out[k].detach() for k in ("energy", "force", "virial")] + grads


@pytest.mark.parametrize(
    "descriptor, angular_davg, nmol",
    [
        (None, False, 3),
        (None, False, 6),  # the window reaches sel for some blocks
        ({"exclude_types": [[0, 1]]}, False, 4),
        (None, True, 3),
    ],
    ids=["window", "dense", "exclude", "davg-angular"],
)
def test_window_matches_plain_sum(descriptor, angular_davg, nmol):
    fast, plain = pair("se_e3", descriptor, angular_davg)
    inputs = batch(fast, periodic=True, nmol=nmol)
    assert_same(outputs_and_grads(fast, inputs), outputs_and_grads(plain, inputs))


@pytest.mark.parametrize(
    "descriptor, angular_davg, nmol",
    [
        ({}, False, 3),
        ({"tebd_input_mode": "strip"}, False, 3),
        ({"tebd_input_mode": "strip", "smooth": False, "concat_output_tebd": False}, False, 3),
        ({"sel": 8}, False, 6),  # truncated lists: every slot real for most atoms
        ({"exclude_types": [[0, 1]]}, False, 4),
        ({"set_davg_zero": False}, True, 3),
        ({"neuron": [9, 18], "resnet_dt": True, "tebd_dim": 4}, False, 3),  # skip on layer 1
    ],
    ids=["concat", "strip", "strip-plain", "dense", "exclude", "davg-angular", "first-skip"],
)
def test_tebd_real_pairs_match_plain_sum(descriptor, angular_davg, nmol):
    fast, plain = pair("se_e3_tebd", descriptor, angular_davg)
    inputs = batch(fast, periodic=True, nmol=nmol)
    assert_same(outputs_and_grads(fast, inputs), outputs_and_grads(plain, inputs))


def test_window_is_narrower_than_sel():
    """The small frames leave padded slots, so the window really cuts the sum."""
    fast, _ = pair()
    nlist = batch(fast, periodic=False, nmol=3)[3]
    window = fast.descriptor.block_windows(nlist)
    assert all(w < s for w, s in zip(window, fast.descriptor.sel))
    real_last = [
        int(np.max(np.nonzero((nlist[..., lo : lo + n] >= 0).reshape(-1, n).numpy())[1])) + 1
        for lo, n in zip(fast.descriptor.offsets, fast.descriptor.sel)
    ]
    assert window == real_last


@pytest.mark.parametrize("mode", ["concat", "strip"])
def test_tebd_pairs_are_those_of_real_slots(mode):
    """The pairs kept, with those counted twice taken in both orders, are every pair of real
    slots once (c² for an atom of c neighbours), fewer than sel² for every atom of these
    frames; a pair is counted twice only where its net input is symmetric."""
    fast, _ = pair("se_e3_tebd", {"tebd_input_mode": mode})
    inputs = batch(fast, periodic=False, nmol=3)
    nnei = fast.descriptor.nnei
    nlist = inputs[3].reshape(-1, nnei)
    real = nlist >= 0
    types = inputs[1][nlist.clamp(min=0)]
    centre, fj, fk, twice = fast.descriptor.pair_slots(real, types)
    counts = real.sum(dim=1)
    assert (counts < nnei).all() and counts.max() > 0
    assert torch.equal(fj // nnei, centre) and torch.equal(fk // nnei, centre)
    got = list(zip(fj.tolist(), fk.tolist())) + list(zip(fk[twice].tolist(), fj[twice].tolist()))
    slots = torch.nonzero(real.reshape(-1)).view(-1)
    want = [(j, k) for j in slots.tolist() for k in slots.tolist() if j // nnei == k // nnei]
    assert sorted(got) == sorted(want) and len(want) == int((counts**2).sum())
    flat = types.reshape(-1)
    assert bool((fj[twice] < fk[twice]).all())
    if mode == "concat":  # twice only where both neighbours have one type
        assert torch.equal(twice, (fj < fk) & (flat[fj] == flat[fk]))
    assert int(twice.sum()) > 0 and len(centre) < len(want)


@pytest.mark.parametrize("kind", CLASSES)
def test_lone_atom_and_no_neighbours(kind):
    """An atom without neighbours, and a batch without any neighbour at all."""
    fast, plain = pair(kind)
    inputs = batch(fast, periodic=False, nmol=2, lone_atom=True)
    assert_same(outputs_and_grads(fast, inputs), outputs_and_grads(plain, inputs))
    empty = inputs[:3] + (torch.full_like(inputs[3], -1), inputs[4])
    e_fast = fast.eval()(*empty)["energy"]
    torch.testing.assert_close(e_fast, plain.eval()(*empty)["energy"], rtol=1e-12, atol=1e-12)
