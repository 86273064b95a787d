"""The model's optimised paths against the straightforward ones, parameter gradients of a
loss on energies, forces and virials included:

* ``EnergyModel.explicit_forces``: dE/d(pair vector) by explicit first-order operations
  instead of ``autograd.grad(create_graph=True)`` and a double backward;
* ``EmbeddingNet.fused_backward``: (G, dG/ds) as one autograd node with a hand-written
  backward instead of plain differentiable operations;
* ``DescriptorSeA.fused_nodes``: embedding + contraction, and the row gradients, as two
  autograd nodes that pass the gradient of G and dG/ds in factored form;
* ``FittingNet.fused_backward``: a fitting net's output and input gradient as one autograd
  node with a written-out backward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.memory import keep_freed_memory
from mdtrain.model import EnergyModel
from mdtrain.model.fused_embedding import _Tape, add_cross_product
from mdtrain.model.network import EmbeddingNet, FittingNet
from mdtrain.neighbors.nlist import build_nlist
from tests.test_model_common import (
    make_model,
    set_random_stats,
    small_config,
    triclinic,
    water_like,
)


def batch(model: EnergyModel, periodic: bool = True, nmol: int = 3, lone_atom: bool = False):
    """Two frames of one system as model inputs; optionally an atom far from all others."""
    box = triclinic(5.0, seed=9) if periodic else None
    frames, atype = [], None
    for seed in (9, 10):
        coord, atype = water_like(nmol, box, seed=seed)
        if lone_atom:  # no neighbour within rcut (non-periodic frames only)
            coord = np.concatenate([coord[:1] + 50.0, coord[1:]])
        frames.append(coord)
    lists = [build_nlist(c, box, atype, model.rcut, model.sel) for c in frames]
    return (
        torch.tensor(np.stack(frames)),
        torch.tensor(atype),
        None if box is None else torch.tensor(np.stack([box, box])),
        torch.tensor(np.stack([nl for nl, _, _ in lists])),
        torch.tensor(np.stack([sh for _, sh, _ in lists])),
    )


def outputs_and_grads(model: EnergyModel, args) -> tuple[dict, list]:
    model.zero_grad()
    out = model(*args)
    loss = (
        out["energy"].sum()
        + (out["force"] ** 2).sum()
        + (out["virial"] ** 2).sum()
        + (out["atom_energy"] ** 2).sum()
    )
    loss.backward()
    grads = [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]
    return {k: v.detach() for k, v in out.items()}, grads


def assert_same(a, b, rtol: float, atol: float) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    for key in out_a:
        torch.testing.assert_close(out_a[key], out_b[key], rtol=rtol, atol=atol)
    for x, y in zip(grads_a, grads_b, strict=True):
        assert y.abs().max() > 0 or x.abs().max() == 0
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol * max(1.0, float(y.abs().max())))


CASES = {
    "one_side": ({}, {}),
    "pairwise": ({"type_one_side": False}, {}),
    "exclude": ({"type_one_side": False, "exclude_types": [[0, 1]]}, {}),
    "exclude_one_side": ({"exclude_types": [[1, 1]]}, {}),
    "atom_exclude": ({}, {"atom_exclude_types": [1]}),
    "env_protection": ({"env_protection": 0.3}, {}),
    "truncated_sel": ({"sel": [3, 5]}, {}),
    "no_resnet_dt": ({"resnet_dt": False}, {}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("periodic", [True, False])
def test_explicit_forces_equal_autograd(case, periodic):
    descriptor, extra = CASES[case]
    model = make_model({"sel": [20, 40], **descriptor}, **extra).train()
    assert model.explicit_forces
    args = batch(model, periodic)
    explicit = outputs_and_grads(model, args)
    model.explicit_forces = False
    reference = outputs_and_grads(model, args)
    assert_same(explicit, reference, rtol=1e-11, atol=1e-12)


def test_explicit_forces_with_an_isolated_atom():
    model = make_model({"sel": [20, 40]}).train()
    args = batch(model, periodic=False, lone_atom=True)
    explicit = outputs_and_grads(model, args)
    assert explicit[0]["force"][:, 0].abs().max() == 0
    model.explicit_forces = False
    assert_same(explicit, outputs_and_grads(model, args), rtol=1e-11, atol=1e-12)


def test_explicit_forces_float32():
    cfg = small_config({"sel": [20, 40], "precision": "float32"}, {"precision": "float32"})
    model = set_random_stats(EnergyModel(cfg)).train()
    args = batch(model)
    explicit = outputs_and_grads(model, args)
    model.explicit_forces = False
    assert_same(explicit, outputs_and_grads(model, args), rtol=2e-4, atol=1e-5)


def test_eval_mode_builds_no_graph_and_other_activations_use_autograd():
    model = make_model({"sel": [20, 40]}).eval()
    out = model(*batch(model))
    assert all(not v.requires_grad for v in out.values())
    relu = make_model({"sel": [20, 40]}, {"activation_function": "relu"})
    assert not relu.explicit_forces  # only tanh nets have the explicit derivative
    out = relu.train()(*batch(relu))
    assert out["force"].requires_grad


@pytest.mark.parametrize("switch", ["skip_padded", "linearize"])
def test_autograd_path_switches_still_agree(switch):
    """The descriptor's switches keep their meaning on the autograd path as well."""
    model = make_model({"sel": [20, 40]}).train()
    model.explicit_forces = False
    args = batch(model)
    assert (args[3][..., :20] < 0).all(dim=(0, 1)).any()  # some columns are padding everywhere
    on = outputs_and_grads(model, args)
    setattr(model.descriptor, switch, False)
    assert_same(on, outputs_and_grads(model, args), rtol=1e-10, atol=1e-12)


@pytest.fixture(params=["one_block", "blocks_of_3"])
def row_blocks(request, monkeypatch):
    """The fused node's forward and backward run over blocks of rows: one, or several."""
    if request.param == "blocks_of_3":
        monkeypatch.setattr(_Tape, "min_block_rows", 1)
        monkeypatch.setattr(_Tape, "block_bytes", 3 * 16 * 8)
    return request.param


@pytest.mark.parametrize(
    "neuron, resnet_dt",
    [
        ([4, 8, 16], False),
        ([4, 8, 16], True),
        ([2, 4, 4, 8], True),
        ([1, 1, 3], True),
        ([3, 5], False),
    ],
)
def test_fused_embedding_backward_equals_plain_operations(neuron, resnet_dt, row_blocks):
    """Every skip kind (none, x, concat(x, x)), with and without idt, first layer included."""
    net = EmbeddingNet(neuron, "tanh", resnet_dt, torch.float64, seed=3)
    s = torch.linspace(-1.5, 2.0, 11, dtype=torch.float64).view(-1, 1).requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    cot = [torch.randn(11, neuron[-1], generator=gen, dtype=torch.float64) for _ in range(2)]
    results = []
    for fused in (True, False):
        net.fused_backward = fused
        g, dg = net.value_and_derivative(s)
        grads = torch.autograd.grad([g, dg], [s, *net.parameters()], cot)
        results.append((g.detach(), dg.detach(), grads))
    (g1, dg1, gr1), (g2, dg2, gr2) = results
    torch.testing.assert_close(g1, g2, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(dg1, dg2, rtol=1e-15, atol=1e-15)
    for a, b in zip(gr1, gr2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


def test_fused_embedding_slope_is_the_derivative():
    """dG/ds against central differences of G (the plain path is checked by the model tests)."""
    net = EmbeddingNet([4, 8, 16], "tanh", True, torch.float64, seed=5)
    s = torch.linspace(-1.0, 1.0, 7, dtype=torch.float64).view(-1, 1)
    _, slope = net.value_and_derivative(s)
    h = 1e-6
    fd = (net(s + h) - net(s - h)) / (2 * h)
    torch.testing.assert_close(slope, fd, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("descriptor", [{}, {"type_one_side": False}], ids=["one_side", "pairwise"])
def test_fused_model_training_matches_plain_operations(descriptor, row_blocks):
    model = make_model({"sel": [20, 40], **descriptor}).train()
    args = batch(model)
    fused = outputs_and_grads(model, args)
    model.descriptor.fused_nodes = False  # the embedding node alone
    assert_same(fused, outputs_and_grads(model, args), rtol=1e-12, atol=1e-13)
    for net in [*model.descriptor.networks, *model.fitting.networks]:
        net.fused_backward = False  # plain operations only
    assert_same(fused, outputs_and_grads(model, args), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize(
    ("neuron", "resnet_dt", "n_in"),
    [([24, 24, 24], True, 12), ([6, 12, 12], False, 6), ([5], True, 7), ([], False, 4)],
)
@pytest.mark.parametrize("cotangents", ["both", "energy", "gradient"])
def test_fused_fitting_equals_plain_operations(neuron, resnet_dt, n_in, cotangents):
    """Every skip kind and idt setting; either output may receive no gradient."""
    net = FittingNet(n_in, neuron, "tanh", resnet_dt, torch.float64, seed=4)
    x = torch.randn(9, n_in, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x.requires_grad_(True)
    gen = torch.Generator().manual_seed(2)
    cot_e = torch.randn(9, 1, generator=gen, dtype=torch.float64)
    cot_g = torch.randn(9, n_in, generator=gen, dtype=torch.float64)
    results = []
    for fused in (True, False):
        net.fused_backward = fused
        e, g = net.value_and_input_grad(x)
        outputs, cots = {"both": ([e, g], [cot_e, cot_g]), "energy": ([e], [cot_e])}.get(
            cotangents, ([g], [cot_g])
        )
        grads = torch.autograd.grad(outputs, [x, *net.parameters()], cots, allow_unused=True)
        results.append((e.detach(), g.detach(), grads))
    (e1, g1, gr1), (e2, g2, gr2) = results
    torch.testing.assert_close(e1, e2, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(g1, g2, rtol=1e-14, atol=1e-14)
    for a, b in zip(gr1, gr2, strict=True):
        if a is None or b is None:  # the output bias does not reach the input gradient
            assert cotangents == "gradient" and (a is None or not a.any())
            assert b is None or not b.any()
            continue
        assert b.abs().max() > 0 or a.abs().max() == 0
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("target", ["energy", "force"])
def test_fused_nodes_with_a_loss_on_energy_or_forces_only(target):
    """The row-gradient node may be absent from the backward (energy only) or be the only
    path into the embedding (forces only)."""
    model = make_model({"sel": [20, 40]}).train()
    args = batch(model)
    grads = []
    for fused in (True, False):
        model.descriptor.fused_nodes = fused
        for net in model.fitting.networks:
            net.fused_backward = fused
        model.zero_grad()
        out = model(*args)
        loss = out["energy"].sum() if target == "energy" else (out["force"] ** 2).sum()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_keep_freed_memory_is_idempotent():
    first = keep_freed_memory()
    assert isinstance(first, bool) and keep_freed_memory() is first


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_models_of_two_shapes_script_in_one_process():
    """The eager-only fused nodes must not tie a scripted method to one net's type."""
    first = torch.jit.script(make_model({"sel": [20, 40]}).eval())
    other = make_model({"sel": [8, 16], "neuron": [2, 4, 8]}, {"neuron": [8, 8]}).eval()
    second = torch.jit.script(other)
    args = batch(other)
    torch.testing.assert_close(second(*args)["force"], other(*args)["force"])
    assert first(*batch(make_model({"sel": [20, 40]})))["energy"].shape == (2,)


@pytest.mark.parametrize("rows", [1024, 1023, 8])
def test_cross_product_split_in_halves_equals_one_product(rows):
    gen = torch.Generator().manual_seed(rows)
    left = torch.randn(rows, 25, generator=gen, dtype=torch.float64)
    right = torch.randn(rows, 50, generator=gen, dtype=torch.float64)
    start = torch.randn(25, 50, generator=gen, dtype=torch.float64)
    total = start.clone()
    add_cross_product(total, left, right)
    torch.testing.assert_close(total, start + left.t() @ right, rtol=1e-13, atol=1e-12)
