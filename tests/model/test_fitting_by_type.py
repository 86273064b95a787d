"""The committee fitting node's per-type split and merge (``fitting_node._SplitByType``,
``_MergeByType``) against plain ``index_select`` / ``zeros().index_copy()``: the same values and
gradients, bit for bit, also with an atom type absent from the frame and with a type's
output unused."""

import pytest
import torch

from mdtrain.model.accel.fitting_node import _MergeByType, _SplitByType


def _groups(atype: torch.Tensor, ntypes: int) -> list[torch.Tensor]:
    return [torch.nonzero(atype == c).view(-1) for c in range(ntypes)]


@pytest.mark.parametrize("atype", [[0, 2, 2, 0, 2, 0], [2, 2, 2, 2, 2, 2], [0, 1, 2, 1, 0, 2]])
def test_split_by_type_equals_index_select(atype):
    atype = torch.tensor(atype)
    groups = _groups(atype, 3)
    x = torch.randn(3, 2, 6, 5, dtype=torch.float64, requires_grad=True)
    parts = _SplitByType.apply(x, groups)
    ref_x = x.detach().clone().requires_grad_(True)
    refs = [ref_x.index_select(2, idx).reshape(3, -1, 5) for idx in groups]
    for p, r in zip(parts, refs, strict=True):
        assert torch.equal(p, r)
    # the last type's part unused: its rows get zero gradient
    weights = [torch.randn_like(r) for r in refs]
    sum((p * w).sum() for p, w in zip(parts[:-1], weights, strict=False)).backward()
    sum((r * w).sum() for r, w in zip(refs[:-1], weights, strict=False)).backward()
    assert torch.equal(x.grad, ref_x.grad)


@pytest.mark.parametrize("atype", [[0, 2, 2, 0, 2, 0], [0, 1, 2, 1, 0, 2]])
def test_merge_by_type_equals_index_copy(atype):
    atype = torch.tensor(atype)
    groups = _groups(atype, 3)
    parts = [
        torch.randn(3, 2, len(idx), 4, dtype=torch.float64, requires_grad=True) for idx in groups
    ]
    out = _MergeByType.apply(groups, 6, *parts)
    ref_parts = [p.detach().clone().requires_grad_(True) for p in parts]
    ref = torch.zeros(3, 2, 6, 4, dtype=torch.float64)
    for idx, p in zip(groups, ref_parts, strict=True):
        ref = ref.index_copy(2, idx, p)
    assert torch.equal(out, ref)
    w = torch.randn_like(ref)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for p, r in zip(parts, ref_parts, strict=True):
        assert torch.equal(p.grad, r.grad)


def test_merge_leaves_atoms_of_no_group_zero():
    groups = [torch.tensor([0, 3]), torch.tensor([1])]  # atom 2 in no group
    parts = [torch.ones(1, 1, 2), torch.full((1, 1, 1), 2.0)]
    out = _MergeByType.apply(groups, 4, *parts)
    assert out.tolist() == [[[1.0, 2.0, 0.0, 1.0]]]


def test_split_and_merge_gradcheck():
    atype = torch.tensor([1, 0, 1, 1, 0])
    groups = _groups(atype, 2)
    x = torch.randn(2, 1, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _SplitByType.apply(t, groups), (x,))
    parts = tuple(
        torch.randn(2, 1, len(i), 3, dtype=torch.float64, requires_grad=True) for i in groups
    )
    assert torch.autograd.gradcheck(lambda *p: _MergeByType.apply(groups, 5, *p), parts)
