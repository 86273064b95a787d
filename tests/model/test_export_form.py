"""`mdtrain.model.export_form`: the form ``torch.export`` traces keeps every parameter and
buffer under its name, leaves the model it copies as it was, runs the parts with a window
read from values over every slot (se_atten's attention, se_e3's blocks, se_e3_tebd's pairs
of real slots), and gives the
eager model's energies, forces and virials to 1e-12 in float64, on frames where the windows
leave slots out (eager only: the exports are tests/infer/test_export_registry.py's)."""

from __future__ import annotations

import pytest
import torch

from mdtrain.model import EnergyModel
from mdtrain.model.descriptors.attention import AttentionStack, FullAttentionStack
from mdtrain.model.descriptors.se_e3 import DescriptorSeT, DescriptorSeTAllSlots
from mdtrain.model.descriptors.se_e3_tebd import DescriptorSeE3Tebd, DescriptorSeE3TebdPadded
from mdtrain.model.export_form import export_form, recast
from tests.helpers.descriptor_battery import battery_config, case_id, layout_cases
from tests.helpers.models import batch, set_random_stats

CASES = layout_cases()


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_export_form_equals_the_model(case):
    model = set_random_stats(EnergyModel(battery_config(*case))).eval()
    form = export_form(model)
    assert list(form.state_dict()) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(form.state_dict()[key], value), key
    kinds = {type(m) for m in model.modules()}
    assert FullAttentionStack not in kinds and DescriptorSeTAllSlots not in kinds
    assert DescriptorSeE3TebdPadded not in kinds
    form_kinds = {type(m) for m in form.modules()}
    assert AttentionStack not in form_kinds and DescriptorSeT not in form_kinds
    assert DescriptorSeE3Tebd not in form_kinds
    assert (DescriptorSeE3TebdPadded in form_kinds) == (DescriptorSeE3Tebd in kinds)
    assert (FullAttentionStack in form_kinds) == (AttentionStack in kinds)
    for periodic in (True, False):
        inputs = batch(model, periodic, nmol=3, lone_atom=not periodic)
        want, got = model(*inputs), form(*inputs)
        for key in ("energy", "atom_energy", "force", "virial"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12, msg=key)


def test_recast_takes_subclasses_only():
    stack = AttentionStack([], True, True)
    with pytest.raises(TypeError, match="is not a"):
        recast(stack, DescriptorSeTAllSlots)
