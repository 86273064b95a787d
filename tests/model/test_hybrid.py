"""The hybrid descriptor's own checks (the battery runs it like every descriptor): each
member sees what it would see alone (its own rcut and sel), or with a type-mixed member what
DeePMD-kit gives it (a type-mixed list, per-type blocks drawn from it), its statistics are
the member's own, and a bad member is named by its index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.config.loader import validate_config
from mdtrain.model import EnergyModel
from mdtrain.model.stats import stat_batch_plan, stream_stat_inputs
from mdtrain.neighbors.nlist import build_nlist
from tests.helpers.descriptor_battery import battery_config
from tests.helpers.models import set_random_stats, water_like
from tests.helpers.stat_systems import make_system


def alone(model: EnergyModel, k: int) -> EnergyModel:
    """Member k of the model's hybrid as a model of its own, with the same parameters."""
    cfg = model.get_model_config()
    cfg["descriptor"] = cfg["descriptor"]["list"][k]
    single = EnergyModel(cfg)
    prefix = f"members.{k}."
    state = {
        n[len(prefix) :]: v
        for n, v in model.descriptor.state_dict().items()
        if n.startswith(prefix)
    }
    single.descriptor.load_state_dict(state)
    return single


@pytest.mark.parametrize("periodic", [True, False])
def test_each_member_sees_its_own_neighbour_list(periodic):
    model = set_random_stats(EnergyModel(battery_config("hybrid", type_one_side=True))).eval()
    assert model.rcut == 3.5 and model.sel == [16, 28]  # the largest of each
    box = np.eye(3) * 6.0 if periodic else None
    coord, atype = water_like(6, box, seed=3)
    at = torch.as_tensor(atype)

    def descriptor_of(m: EnergyModel) -> torch.Tensor:
        nlist, shift, counts = build_nlist(coord, box, atype, m.rcut, m.sel)
        assert (counts <= np.asarray(m.sel)).all()  # no truncation: the lists are complete
        nl = torch.as_tensor(nlist)[None]
        x = torch.as_tensor(coord)[None]
        cell = None if box is None else torch.as_tensor(box)[None]
        diff = m.pair_vectors(x, cell, nl, torch.as_tensor(shift)[None])
        return m.descriptor(diff, nl, at)[0].detach()

    whole = descriptor_of(model)
    start = 0
    for k in range(2):
        single = alone(model, k)
        assert single.rcut < model.rcut or single.sel != model.sel
        part = descriptor_of(single)
        torch.testing.assert_close(
            whole[:, start : start + part.shape[1]], part, rtol=1e-13, atol=1e-14
        )
        start += part.shape[1]
    assert start == whole.shape[1] == model.descriptor.dim_out


@pytest.mark.parametrize("variant", [{}, {"members": "mixed"}], ids=["per-type", "mixed"])
def test_statistics_are_each_members_own(variant):
    systems = [make_system(3, True, 3, 1), make_system(2, False, 2, 2)]
    model = EnergyModel(battery_config("hybrid", variant, exclude_types=[[0, 1]]))
    plan = stat_batch_plan(systems, 2)
    items = stream_stat_inputs(systems, model, plan, show_progress=False)[0]
    davg, dstd = model.descriptor.stats_from_items(items)
    model.descriptor.set_stats(torch.from_numpy(davg), torch.from_numpy(dstd))
    for k, member in enumerate(model.descriptor.members):
        single = alone(model, k)
        own = stream_stat_inputs(systems, single, plan, show_progress=False)[0]
        m_avg, m_std = single.descriptor.stats_from_items(own)
        np.testing.assert_allclose(member.davg.numpy(), m_avg, rtol=1e-12)
        np.testing.assert_allclose(member.dstd.numpy(), m_std, rtol=1e-12)
        assert not np.allclose(m_std, 1.0)


def hybrid_input(**member1) -> dict:
    desc = battery_config("hybrid")["descriptor"]
    desc["list"][1].update(member1)
    return {
        "model": {"type_map": ["O", "H"], "descriptor": desc, "fitting_net": {}},
        "training": {"training_data": {"systems": ["data"]}, "numb_steps": 1},
    }


@pytest.mark.parametrize(
    ("member", "expected"),
    [
        ({"sel": [4]}, "model.descriptor.list[1].sel: needs one entry per element"),
        ({"rcut_smth": 9.0}, "model.descriptor.list[1].rcut_smth: must be smaller than rcut"),
        ({"axis_neuron": 4}, "model.descriptor.list[1].axis_neuron: unknown key"),
        ({"type": "se_bogus"}, "model.descriptor.list[1].type: "),
        ({"type": "hybrid"}, "model.descriptor.list[1]"),
    ],
)
def test_a_bad_member_is_named_by_its_index(member, expected):
    problems = validate_config(hybrid_input(**member))
    assert any(p.startswith(expected) and "\n" not in p for p in problems), problems


def test_neighbor_stat_of_a_hybrid_input_takes_its_largest_rcut(tmp_path):
    import json

    from mdtrain.cli import main
    from tests.helpers.training import make_project

    inp = make_project(tmp_path)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"] = battery_config("hybrid")["descriptor"]
    inp.write_text(json.dumps(config))
    assert main(["neighbor-stat", str(inp), "-o", str(tmp_path / "stat.json")]) == 0
    assert json.loads((tmp_path / "stat.json").read_text())["rcut"] == 3.5


def test_parameters_are_counted_before_the_members_sel_is_known():
    from mdtrain.train.ensemble_budget import count_parameters

    cfg = battery_config("hybrid", sel="auto")
    known = EnergyModel(battery_config("hybrid"))
    assert count_parameters(cfg) == sum(p.numel() for p in known.parameters())


def _mixed_hybrid() -> EnergyModel:
    return set_random_stats(EnergyModel(battery_config("hybrid", {"members": "mixed"}))).eval()


def test_a_type_mixed_member_makes_the_hybrid_type_mixed():
    """DeePMD-kit's hybrid: type-mixed when any member is; one list of the largest member
    total; the per-type members' blocks drawn with the element-wise largest per-type sel;
    one fitting net."""
    from mdtrain.neighbors.layout import MIXED, layout_of

    model = _mixed_hybrid()
    desc = model.descriptor
    assert model.mixed_types and layout_of(model) is MIXED and model.fitting.mixed_types
    assert model.sel == [max(m.nnei for m in desc.members)] == [30]
    assert desc.split_sel == [8, 16] and desc.member_split == [False, True]


@pytest.mark.parametrize("periodic", [True, False])
def test_members_of_a_type_mixed_hybrid_see_deepmd_kits_lists(periodic):
    """The type-mixed member equals itself alone on the first ``sel`` slots of a type-mixed
    list at the hybrid's rcut; the per-type member equals itself alone on its own per-type
    list (nothing cut short here: the blocks drawn from the type-mixed list are complete)."""
    from mdtrain.neighbors.mixed_nlist import build_mixed_nlist

    model = _mixed_hybrid()
    box = np.eye(3) * 6.0 if periodic else None
    coord, atype = water_like(6, box, seed=3)
    at, x = torch.as_tensor(atype), torch.as_tensor(coord)[None]
    cell = None if box is None else torch.as_tensor(box)[None]

    def descriptor_of(m: EnergyModel, rcut: float, mixed: bool) -> torch.Tensor:
        if mixed:
            nlist, shift, counts = build_mixed_nlist(coord, box, rcut, m.sel[0])
        else:
            nlist, shift, counts = build_nlist(coord, box, atype, rcut, m.sel)
        assert (counts <= np.asarray(m.sel)).all()  # complete lists
        nl = torch.as_tensor(nlist)[None]
        diff = m.pair_vectors(x, cell, nl, torch.as_tensor(shift)[None])
        return m.descriptor(diff, nl, at)[0].detach()

    whole = descriptor_of(model, model.rcut, True)
    first, second = alone(model, 0), alone(model, 1)
    assert first.rcut < model.rcut  # the hybrid's list reaches beyond it
    width = first.descriptor.dim_out
    part = descriptor_of(first, model.rcut, True)
    torch.testing.assert_close(whole[:, :width], part, rtol=1e-13, atol=1e-14)
    part = descriptor_of(second, second.rcut, False)
    torch.testing.assert_close(whole[:, width:], part, rtol=1e-13, atol=1e-14)


def test_per_type_blocks_are_drawn_as_deepmd_kit_draws_them():
    """``split_by_type`` against a plain loop of DeePMD-kit's ``nlist_distinguish_types``
    on a random type-mixed list (cut short: some types have more neighbours than their
    block), the vectors following their slots."""
    model = _mixed_hybrid()
    desc = model.descriptor
    rng = np.random.default_rng(0)
    natoms, nnei = 7, desc.nnei
    atype = torch.as_tensor(rng.integers(0, 2, natoms))
    nlist = torch.as_tensor(rng.integers(-1, natoms, (2, natoms, nnei)))
    diff = torch.as_tensor(rng.normal(size=(2, natoms, nnei, 3)))
    got_diff, got = desc.split_by_type(diff, nlist, atype)
    assert got.shape == (2, natoms, sum(desc.split_sel))
    for f in range(2):
        for i in range(natoms):
            row, start = nlist[f, i].tolist(), 0
            for t, count in enumerate(desc.split_sel):
                slots = [s for s, j in enumerate(row) if j >= 0 and int(atype[j]) == t][:count]
                want = [row[s] for s in slots] + [-1] * (count - len(slots))
                assert got[f, i, start : start + count].tolist() == want
                for k, s in enumerate(slots):
                    assert torch.equal(got_diff[f, i, start + k], diff[f, i, s])
                start += count
    assert (got >= 0).sum() < (nlist >= 0).sum()  # some neighbours were left out


def test_a_nested_hybrid_is_refused_by_its_index():
    from mdtrain.errors import MDTrainError
    from mdtrain.model.config import normalize_model_config

    members = [{"type": "se_e2_a", "sel": [4, 8], "rcut": 3.0}, {"type": "hybrid", "list": []}]
    config = {"type_map": ["O", "H"], "descriptor": {"type": "hybrid", "list": members}}
    with pytest.raises(MDTrainError, match=r"model/descriptor/list\[1\]/type: a hybrid"):
        normalize_model_config(config)
