"""The fitting nets per atom type. The committee fitting node's per-type split and merge
(``fitting_node._SplitByType``, ``_MergeByType``) against plain ``index_select`` /
``zeros().index_copy()``: the same values and gradients, bit for bit, also with an atom type
absent from the frame and with a type's output unused. One model's node for all types
(``fitting_types.TypesValueAndInputGrad``) against a plain node per type, bit for bit, and
against finite differences."""

import pytest
import torch

from mdtrain.model.accel.fitting_node import (
    _MergeByType,
    _SplitByType,
    _ValueAndInputGrad,
    fitting_with_grad,
)
from mdtrain.model.accel.fitting_types import (
    TypesValueAndInputGrad,
    cached_type_rows,
    type_rows,
)
from mdtrain.model.accel.layout import layer_layout, layer_params
from mdtrain.model.fitting import EnergyFitting


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


def _per_type_nodes(fitting, descriptor, atype):
    """The plain composition the by-type node replaces: per type, ``index_select`` of its
    atoms, one ``_ValueAndInputGrad`` node, ``index_copy`` back into zeros."""
    nf, natoms, dim = descriptor.shape
    out = torch.zeros(nf, natoms, dtype=torch.float64)
    grad = torch.zeros(nf, natoms, dim, dtype=fitting.dtype)
    for c, net in enumerate(fitting.networks):
        idx = torch.nonzero(atype == c).view(-1)
        d_c = descriptor.index_select(1, idx).reshape(-1, dim)
        layout = layer_layout(net.layers[:-1])
        e_c, g_c = _ValueAndInputGrad.apply(d_c, layout, *layer_params(net.layers))
        out = out.index_copy(1, idx, e_c.view(nf, -1).to(torch.float64))
        grad = grad.index_copy(1, idx, g_c.reshape(nf, -1, dim))
    return out, grad


def _outputs_and_grads(fn, fitting, descriptor, atype, terms):
    d = descriptor.clone().requires_grad_(True)
    energy, grad = fn(fitting, d, atype)
    gen = torch.Generator().manual_seed(7)
    loss = 0.0
    if "energy" in terms:
        loss = loss + (energy * torch.randn(energy.shape, generator=gen, dtype=energy.dtype)).sum()
    if "gradient" in terms:
        loss = loss + (grad * torch.randn(grad.shape, generator=gen, dtype=grad.dtype)).sum()
    params = list(fitting.parameters())
    grads = torch.autograd.grad(loss, [d, *params], allow_unused=True)
    return [energy.detach(), grad.detach(), *grads]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("atype", "nf", "neuron"),
    [
        ([0, 1, 1, 0, 1, 1], 1, [16, 16, 16]),
        ([1, 0, 2, 1, 1, 0, 2, 1], 3, [6, 12, 12]),  # a doubling skip (6 -> 12)
        ([2, 2, 0, 2], 2, [8, 8]),  # type 1 absent: its net's gradients are zeros
        # odd widths and counts: the blocks padded to aligned rows, as MKL needs for the bits
        ([0] * 5 + [1] * 11 + [2] * 3, 1, [7, 7, 7]),
        ([1, 0, 2] * 5, 2, [25, 50]),
        # one frame sorted by type, aligned blocks: no gather or scatter at all
        ([0] * 16 + [1] * 5, 1, [16, 16, 16]),
        ([0] * 16 + [1] * 32 + [2] * 3, 1, [6, 12]),
    ],
)
@pytest.mark.parametrize("terms", [("energy", "gradient"), ("energy",), ("gradient",)])
def test_fitting_with_grad_equals_a_node_per_type(dtype, atype, nf, neuron, terms):
    """One node for every type's net (``fitting_with_grad``) gives the bits of a
    ``_ValueAndInputGrad`` per type: outputs, dL/dD and every parameter's gradient."""
    atype = torch.tensor(atype)
    fitting = EnergyFitting(3, 10, neuron, resnet_dt=True, dtype=dtype, seed=5)
    gen = torch.Generator().manual_seed(nf)
    descriptor = torch.randn(nf, len(atype), 10, generator=gen, dtype=dtype)
    fused = _outputs_and_grads(fitting_with_grad, fitting, descriptor, atype, terms)
    plain = _outputs_and_grads(_per_type_nodes, fitting, descriptor, atype, terms)
    for a, b in zip(fused, plain, strict=True):
        if a is None or b is None:  # the output bias does not reach dE/dD
            assert a is None and b is None and terms == ("gradient",)
            continue
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_by_type_node_gradcheck():
    atype = torch.tensor([1, 0, 1, 1, 0])
    fitting = EnergyFitting(2, 4, [5, 5], resnet_dt=True, dtype=torch.float64, seed=2)
    params = [p for net in fitting.networks for p in layer_params(net.layers)]
    layout = layer_layout(fitting.networks[0].layers[:-1])
    rows = type_rows(atype, 2, 2)
    d = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, *p: TypesValueAndInputGrad.apply(x, rows, layout, *p), (d, *params)
    )


def test_atoms_of_no_net_get_zeros():
    """Atoms whose type has no net (here type 2 of a two-net fitting) get zero energy and
    gradient, and no gradient flows to their descriptor rows."""
    atype = torch.tensor([0, 2, 1, 2])
    fitting = EnergyFitting(2, 3, [4], resnet_dt=True, dtype=torch.float64, seed=1)
    d = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    energy, grad = fitting_with_grad(fitting, d, atype)
    assert energy[0, [1, 3]].eq(0).all() and grad[0, [1, 3]].eq(0).all()
    assert energy[0, [0, 2]].ne(0).all()
    (energy.sum() + grad.square().sum()).backward()
    assert d.grad[0, [1, 3]].eq(0).all() and d.grad[0, [0, 2]].ne(0).all()
    ref_e, ref_g = _per_type_nodes(fitting, d.detach(), atype)
    assert torch.equal(energy, ref_e) and torch.equal(grad, ref_g)


@pytest.mark.parametrize("by_type", [True, False])
def test_parameter_gradients_without_descriptor_gradient(by_type):
    """A descriptor that needs no gradient (a frozen descriptor) skips dL/dD, whose first
    layer's product is the largest of the reverse; the parameters' gradients keep their bits."""
    atype = torch.tensor([0, 1, 1, 0, 1])
    fitting = EnergyFitting(2, 6, [8, 8, 8], resnet_dt=True, dtype=torch.float64, seed=3)
    descriptor = torch.randn(2, 5, 6, dtype=torch.float64)
    params = list(fitting.parameters())
    grads = []
    for needed in (True, False):
        d = descriptor.clone().requires_grad_(needed)
        if by_type:
            energy, grad = fitting_with_grad(fitting, d, atype)
        else:
            net = fitting.networks[1]
            layout = layer_layout(net.layers[:-1])
            energy, grad = _ValueAndInputGrad.apply(d[0], layout, *layer_params(net.layers))
        loss = energy.sum() + grad.square().sum()
        grads.append(torch.autograd.grad(loss, params, allow_unused=True))
    for a, b in zip(*grads, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert any(g is not None for g in grads[1])


@pytest.mark.parametrize(
    ("atype", "nf", "ordered"),
    [
        ([0] * 16 + [1] * 5, 1, True),
        ([0] * 16 + [1] * 5, 2, False),  # frame-major within a type: not the atoms' order
        ([1] * 7, 3, True),  # one type, every frame
        ([0] * 3 + [1] * 5, 1, False),  # type 0's block padded to 16 rows
        ([1, 0] * 8, 1, False),
        ([0] * 16 + [2] * 4, 1, False),  # type 2 has no net
    ],
)
def test_type_rows_ordered(atype, nf, ordered):
    """``ordered`` (rows used in place, no gather) exactly where the by-type order is the
    atoms' own order; the index then is every row in turn."""
    ntypes = 2
    rows = type_rows(torch.tensor(atype), ntypes, nf)
    assert rows.ordered == ordered
    if ordered:
        assert torch.equal(rows.index, torch.arange(nf * len(atype)))


def test_cached_type_rows_follows_the_types():
    a = torch.tensor([0] * 16 + [1] * 5)
    first = cached_type_rows(a, 2, 1)
    assert cached_type_rows(a.clone(), 2, 1) is first
    for atype, nf in ((a.flip(0), 1), (a, 2)):
        rows = cached_type_rows(atype, 2, nf)
        expected = type_rows(atype, 2, nf)
        assert rows.bounds == expected.bounds and torch.equal(rows.index, expected.index)
