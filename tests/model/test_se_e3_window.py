"""se_e3's windowed, symmetric three-body sum (``DescriptorSeT``) against the plain sum over
every pair of slots (``DescriptorSeTPadded``): energies, forces, virials and the training
gradients of an energy + force loss, float64, to 1e-12."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mdtrain.model import EnergyModel
from mdtrain.model.descriptors.se_e3 import DescriptorSeT, DescriptorSeTPadded
from tests.helpers.models import batch, set_random_stats, small_config

SE_E3 = {"type": "se_e3", "sel": [10, 20], "neuron": [2, 4, 8], "seed": 3}


def pair(descriptor: dict | None = None, angular_davg: bool = False):
    """The same model with the windowed sum and with the plain one."""
    cfg = small_config({**SE_E3, **(descriptor or {})})
    for key in ("axis_neuron", "type_one_side"):  # se_e2_a's keys, not se_e3's
        del cfg["descriptor"][key]
    fast = set_random_stats(EnergyModel(cfg))
    if angular_davg:  # padded rows nonzero: every slot must enter
        with torch.no_grad():
            fast.descriptor.davg[:, :, 1:] += 0.05
    assert type(fast.descriptor) is DescriptorSeT
    plain = copy.deepcopy(fast)
    plain.descriptor.__class__ = DescriptorSeTPadded
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
    fast, plain = pair(descriptor, angular_davg)
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


def test_lone_atom_and_no_neighbours():
    """An atom without neighbours, and a batch where a whole type block is empty."""
    fast, plain = pair()
    inputs = batch(fast, periodic=False, nmol=2, lone_atom=True)
    assert_same(outputs_and_grads(fast, inputs), outputs_and_grads(plain, inputs))
    empty = inputs[:3] + (torch.full_like(inputs[3], -1), inputs[4])
    e_fast = fast.eval()(*empty)["energy"]
    torch.testing.assert_close(e_fast, plain.eval()(*empty)["energy"], rtol=1e-12, atol=1e-12)
