"""The environment's group order (``environment_node.pair_plan``), kept per system's atom
types: against a brute-force order, and never stale when the types change."""

from __future__ import annotations

import pytest
import torch

from mdtrain.model.accel import environment_node as en


def _brute(one_side: bool, ntypes: int, nf: int, atype: list[int]) -> list[int]:
    """Each row's frame·N + atom: atom order, or per type, frame-major in each type."""
    natoms = len(atype)
    if one_side:
        return list(range(nf * natoms))
    return [
        f * natoms + i
        for c in range(ntypes)
        for f in range(nf)
        for i in range(natoms)
        if atype[i] == c
    ]


@pytest.mark.parametrize("one_side", [True, False])
@pytest.mark.parametrize("nf", [1, 3])
@pytest.mark.parametrize("atype", [[0, 0, 1, 1, 1], [1, 0, 2, 1, 0], [2, 2, 0, 0, 1]])
def test_plan_matches_brute_force_and_is_kept(one_side, nf, atype):
    torch.manual_seed(nf)
    natoms, nnei, ntypes = len(atype), 4, 3
    nlist = torch.randint(-1, natoms, (nf, natoms, nnei))
    diff = torch.randn(nf, natoms, nnei, 3, dtype=torch.float64)
    types = torch.tensor(atype)
    centre = _brute(one_side, ntypes, nf, atype)
    for _ in range(2):  # computed, then kept
        plan, nl = en.pair_plan(one_side, ntypes, diff, nlist, types.clone())
        assert plan.centre.tolist() == centre
        assert plan.types.tolist() == [atype[c % natoms] for c in centre]
        counts = [sum(t == c for t in atype) * nf for c in range(ntypes)]
        bounds = [0, nf * natoms] if one_side else [sum(counts[:c]) for c in range(ntypes + 1)]
        assert plan.bounds == bounds
        rows = nlist.reshape(nf * natoms, nnei)[centre]
        assert torch.equal(nl, rows)
        assert torch.equal(plan.vectors, diff.reshape(nf * natoms, nnei, 3)[centre])
        base = torch.tensor([c // natoms * natoms for c in centre]).view(-1, 1)
        assert torch.equal(plan.neighbour, (rows.clamp(min=0) + base).view(-1))
        plan.bounds.append(-1)  # a caller's list: the kept order is not changed by it


def test_changed_types_give_their_own_order():
    nlist = torch.zeros(1, 4, 2, dtype=torch.long)
    diff = torch.zeros(1, 4, 2, 3, dtype=torch.float64)
    types = torch.tensor([0, 1, 0, 1])
    first, _ = en.pair_plan(False, 2, diff, nlist, types)
    types[0] = 1  # the same tensor, written to: a new key
    second, _ = en.pair_plan(False, 2, diff, nlist, types)
    assert first.centre.tolist() == [0, 2, 1, 3]
    assert second.centre.tolist() == [2, 0, 1, 3]
    assert second.bounds == [0, 1, 4]


def test_order_made_in_inference_mode_serves_training():
    types = torch.tensor([1, 0, 1, 0, 0, 1, 1])
    nlist = torch.zeros(2, 7, 3, dtype=torch.long)
    diff = torch.randn(2, 7, 3, 3, dtype=torch.float64)
    with torch.inference_mode():
        en.pair_plan(False, 2, diff, nlist, types)
    plan, _ = en.pair_plan(False, 2, diff.requires_grad_(), nlist, types)
    rows = diff.reshape(14, 3, 3).index_select(0, plan.centre)  # saves centre for backward
    rows.sum().backward()
    assert torch.equal(diff.grad, torch.ones_like(diff))
