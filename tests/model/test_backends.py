"""Every backend of the model against the reference (``mdtrain.model.backend``): energies,
forces, virials and the parameter gradients of a loss on all of them, with the backend that
actually ran asserted from the autograd graph, not only from its name; for each descriptor
with an explicit form (se_e2_a, se_e2_r) and a hybrid of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model import EnergyModel
from mdtrain.model.accel.embedding_nodes import Tape, _EmbedContract
from mdtrain.model.accel.fitting_node import _ValueAndInputGrad
from mdtrain.model.accel.kernels import load_kernels
from mdtrain.model.accel.layout import add_cross_product, layer_layout, layer_params
from mdtrain.model.backend import as_reference, build_committee, build_model, choose_backend
from mdtrain.model.committee import Committee
from mdtrain.model.config import normalize_model_config
from mdtrain.model.network import EmbeddingNet, FittingNet
from mdtrain.neighbors.layout import layout_of
from tests.helpers.models import batch, set_random_stats, small_config


def _kernels_available() -> bool:
    try:
        load_kernels()
    except RuntimeError:
        return False
    return True


ACCELERATED = ["fused", pytest.param("kernels", marks=pytest.mark.skipif(
    not _kernels_available(), reason="no C++ compiler for the kernels"))]  # fmt: skip
# autograd node that only the named backend puts in the graph
SIGNATURE = {"fused": "_EmbedContractBackward", "kernels": "_KernelEmbedContractBackward"}
# the descriptors the accelerated backends run, as settings over ``small_config``'s se_e2_a
TYPES = {"se_e2_a": {}, "se_e2_r": {"type": "se_e2_r"}, "hybrid": {}}
# a hybrid's members over the same settings: the angular one within a shorter rcut, so that
# it sees neighbours of the list beyond its own cut-off
HYBRID_MEMBERS = [
    {"rcut": 3.0, "rcut_smth": 0.4, "neuron": [4, 6], "axis_neuron": 3, "seed": 5},
    {"type": "se_e2_r", "seed": 6},
]


def descriptor_of(kind: str, settings: dict) -> dict:
    """``kind``'s section with ``settings`` over ``small_config``'s se_e2_a (a hybrid: each
    member's)."""
    if kind != "hybrid":
        return {**TYPES[kind], **settings}
    base = small_config()["descriptor"]
    return {"type": "hybrid", "list": [{**base, **settings, **m} for m in HYBRID_MEMBERS]}


def model_for(backend: str, descriptor: dict | None = None, fitting: dict | None = None, **kw):
    cfg = small_config(descriptor, fitting, **kw)
    if descriptor is not None and descriptor.get("type") == "hybrid":
        cfg["descriptor"] = descriptor  # its list only, no se_e2_a keys beside it
    model = build_model(cfg, backend=backend)
    assert model.backend == backend
    return set_random_stats(model).train()


def graph_nodes(tensor: torch.Tensor) -> set[str]:
    """Class names of every autograd node ``tensor`` depends on."""
    seen, todo, names = set(), [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [nxt for nxt, _ in node.next_functions]
    return names


def outputs_and_grads(model: EnergyModel, args) -> tuple[dict, list]:
    model.zero_grad()
    out = model(*args)
    loss = (
        out["energy"].sum()
        + (out["force"] ** 2).sum()
        + (out["virial"] ** 2).sum()
        + (out["atom_energy"] ** 2).sum()
    )
    nodes = graph_nodes(loss)
    for name, signature in SIGNATURE.items():
        assert (signature in nodes) == (model.backend == name), (model.backend, name)
    # the explicit backends' force node: ``accel.force_node``'s on the fused backend, the
    # compiled one (``accel.pair_kernels``) on the kernels backend
    assert ("_ForcePathBackward" in nodes) == (model.backend == "fused"), model.backend
    assert ("_CompiledForcePathBackward" in nodes) == (model.backend == "kernels"), model.backend
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


@pytest.mark.parametrize("backend", ACCELERATED)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("periodic", [True, False])
@pytest.mark.parametrize("kind", TYPES)
def test_accelerated_backends_equal_the_reference(backend, case, periodic, kind):
    descriptor, extra = CASES[case]
    descriptor = descriptor_of(kind, {"sel": [20, 40], **descriptor})
    fast = model_for(backend, descriptor, **extra)
    args = batch(fast, periodic)
    reference = model_for("reference", descriptor, **extra)
    assert_same(outputs_and_grads(fast, args), outputs_and_grads(reference, args), 1e-11, 1e-12)


@pytest.mark.parametrize("backend", ACCELERATED)
@pytest.mark.parametrize("kind", TYPES)
def test_isolated_atom(backend, kind):
    descriptor = descriptor_of(kind, {"sel": [20, 40]})
    fast = model_for(backend, descriptor)
    args = batch(fast, periodic=False, lone_atom=True)
    result = outputs_and_grads(fast, args)
    assert result[0]["force"][:, 0].abs().max() == 0
    reference = outputs_and_grads(model_for("reference", descriptor), args)
    assert_same(result, reference, rtol=1e-11, atol=1e-12)


MISSING = {"one_side": {}, "pairwise": {"type_one_side": False}}


@pytest.mark.parametrize("backend", ACCELERATED)
@pytest.mark.parametrize("setting", MISSING)
@pytest.mark.parametrize("kind", TYPES)
def test_a_type_missing_from_the_frames(backend, setting, kind):
    descriptor = {"sel": [20, 40], **TYPES[kind], **MISSING[setting]}
    fast = model_for(backend, descriptor)
    coord, _, box, _, _ = batch(fast, periodic=True)
    atype = np.ones(coord.shape[1], dtype=np.int64)  # no atom of type 0 in any frame
    lists = [
        layout_of(fast).build(c, b, atype, fast.rcut, fast.sel)
        for c, b in zip(coord.numpy(), box.numpy(), strict=True)
    ]
    args = (
        coord,
        torch.tensor(atype),
        box,
        torch.tensor(np.stack([x[0] for x in lists])),
        torch.tensor(np.stack([x[1] for x in lists])),
    )
    result = outputs_and_grads(fast, args)
    reference = model_for("reference", descriptor)
    assert_same(result, outputs_and_grads(reference, args), 1e-11, 1e-12)


@pytest.mark.parametrize("backend", ACCELERATED)
@pytest.mark.parametrize("kind", TYPES)
def test_float32(backend, kind):
    desc = descriptor_of(kind, {"sel": [20, 40], "precision": "float32"})
    fit = {"precision": "float32"}
    fast = model_for(backend, desc, fit)
    args = batch(fast)
    reference = outputs_and_grads(model_for("reference", desc, fit), args)
    assert_same(outputs_and_grads(fast, args), reference, rtol=2e-4, atol=1e-5)


@pytest.fixture(params=["one_block", "blocks_of_3"])
def row_blocks(request, monkeypatch):
    """The fused node's forward and backward run over blocks of rows: one, or several."""
    if request.param == "blocks_of_3":
        monkeypatch.setattr(Tape, "min_block_rows", 1)
        monkeypatch.setattr(Tape, "block_bytes", 3 * 16 * 8)
    return request.param


@pytest.mark.parametrize("descriptor", [{}, {"type_one_side": False}], ids=["one_side", "pairwise"])
@pytest.mark.parametrize("kind", TYPES)
def test_fused_nodes_over_blocks_of_rows(descriptor, kind, row_blocks):
    descriptor = descriptor_of(kind, {"sel": [20, 40], **descriptor})
    fast = model_for("fused", descriptor)
    args = batch(fast)
    reference = outputs_and_grads(model_for("reference", descriptor), args)
    assert_same(outputs_and_grads(fast, args), reference, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("backend", ACCELERATED)
@pytest.mark.parametrize("target", ["energy", "force"])
@pytest.mark.parametrize("kind", TYPES)
def test_loss_on_energy_or_forces_only(backend, target, kind):
    """The row-gradient node may be absent from the backward (energy only) or be the only
    path into the embedding (forces only)."""
    grads = []
    for name in (backend, "reference"):
        model = model_for(name, descriptor_of(kind, {"sel": [20, 40]}))
        out = model(*batch(model))
        loss = out["energy"].sum() if target == "energy" else (out["force"] ** 2).sum()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize(
    "neuron, resnet_dt",
    [([4, 8, 16], False), ([4, 8, 16], True), ([2, 4, 4, 8], True), ([1, 1, 3], True)],
)
def test_fused_embedding_node_equals_forward_mode_autograd(neuron, resnet_dt, row_blocks):
    """T, G, dG/ds and the parameter gradients of a loss on all three, against the reference
    net differentiated by torch.func.jvp; every skip kind, with and without idt."""
    net = EmbeddingNet(neuron, "tanh", resnet_dt, torch.float64, seed=3)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 4, 7, generator=gen, dtype=torch.float64)
    cot = [torch.randn(5, 4, neuron[-1], generator=gen, dtype=torch.float64)]
    cot += [torch.randn(5, 7, neuron[-1], generator=gen, dtype=torch.float64) for _ in range(2)]
    params = layer_params(net.layers)
    fused = _EmbedContract.apply(rows, layer_layout(net.layers), *params)
    s = rows[:, 0].reshape(-1, 1)
    value, slope = torch.func.jvp(net, (s,), (torch.ones_like(s),))
    value, slope = value.view(5, 7, -1), slope.view(5, 7, -1)
    plain = (torch.bmm(rows, value), value, slope)
    results = []
    for outputs in (fused, plain):
        loss = sum((c * o).sum() for c, o in zip(cot, outputs, strict=True))
        results.append([*(o.detach() for o in outputs), *torch.autograd.grad(loss, params)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize(
    ("neuron", "resnet_dt", "n_in"),
    [([24, 24, 24], True, 12), ([6, 12, 12], False, 6), ([5], True, 7), ([], False, 4)],
)
@pytest.mark.parametrize("cotangents", ["both", "energy", "gradient"])
def test_fused_fitting_node_equals_double_backward(neuron, resnet_dt, n_in, cotangents):
    """Output and input gradient of a fitting net, and the parameter gradients of a loss on
    either or both, against autograd's double backward through the reference net."""
    net = FittingNet(n_in, neuron, "tanh", resnet_dt, torch.float64, seed=4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, n_in, generator=gen, dtype=torch.float64).requires_grad_(True)
    cot_e = torch.randn(9, 1, generator=gen, dtype=torch.float64)
    cot_g = torch.randn(9, n_in, generator=gen, dtype=torch.float64)
    params = list(net.parameters())
    fused = _ValueAndInputGrad.apply(x, layer_layout(net.layers[:-1]), *params)
    e = net(x)
    plain = (e, torch.autograd.grad(e.sum(), x, create_graph=True)[0])
    terms = {"both": [(cot_e, 0), (cot_g, 1)], "energy": [(cot_e, 0)], "gradient": [(cot_g, 1)]}
    results = []
    for outputs in (fused, plain):
        loss = sum((c * outputs[i]).sum() for c, i in terms[cotangents])
        grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
        results.append((outputs[0].detach(), outputs[1].detach(), grads))
    (e1, g1, gr1), (e2, g2, gr2) = results
    torch.testing.assert_close(e1, e2, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(g1, g2, rtol=1e-13, atol=1e-14)
    for a, b in zip(gr1, gr2, strict=True):
        if a is None or b is None:  # the output bias does not reach the input gradient
            assert cotangents == "gradient" and (a is None or not a.any())
            assert b is None or not b.any()
            continue
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_choice_order_and_forcing(monkeypatch):
    monkeypatch.delenv("MDTRAIN_BACKEND", raising=False)
    tanh = normalize_model_config(small_config())
    first = "kernels" if _kernels_available() else "fused"
    assert choose_backend(tanh, torch.device("cpu"))[0] == first
    assert choose_backend(tanh, torch.device("meta"))[0] == "fused"  # kernels: CPU tensors only
    assert choose_backend(tanh, torch.device("cpu"), "bf16")[0] == "reference"
    relu = normalize_model_config(small_config(None, {"activation_function": "relu"}))
    assert choose_backend(relu, torch.device("cpu")) == (
        "reference",
        "kernels: model.fitting_net.activation_function is 'relu' (needs tanh); "
        "fused: model.fitting_net.activation_function is 'relu' (needs tanh)",
    )
    monkeypatch.setenv("MDTRAIN_BACKEND", "fused")
    assert build_model(small_config()).backend == "fused"
    with pytest.raises(MDTrainError, match="backend 'fused' cannot run here.*relu"):
        build_model(small_config(None, {"activation_function": "relu"}))
    monkeypatch.setenv("MDTRAIN_BACKEND", "fast")
    with pytest.raises(MDTrainError, match="MDTRAIN_BACKEND='fast' is not one of"):
        build_model(small_config())


def test_descriptors_without_an_explicit_form_run_the_reference(monkeypatch):
    monkeypatch.delenv("MDTRAIN_BACKEND", raising=False)
    se_e3 = normalize_model_config(small_config({"type": "se_e3", "sel": [20, 40]}))
    name, why = choose_backend(se_e3, torch.device("cpu"))
    assert name == "reference"
    assert "model.descriptor.type is 'se_e3' (accelerated: se_e2_a, se_e2_r, a hybrid" in why
    radial = normalize_model_config(small_config({"type": "se_e2_r"}))
    assert choose_backend(radial, torch.device("cpu"))[0] == (
        "kernels" if _kernels_available() else "fused"
    )


@pytest.mark.parametrize("backend", ACCELERATED)
@pytest.mark.parametrize("periodic", [True, False])
def test_hybrid_members_with_lists_of_their_own(backend, periodic):
    """Three members, two of one type, each with its own rcut and sel (slots of the model's
    list that several members take, slots that one takes, neighbours beyond a member's rcut),
    one pairwise with excluded pairs: on the accelerated backend as on the reference."""
    base = small_config()["descriptor"]
    members = [
        {**base, "sel": [6, 12], "rcut": 2.8, "seed": 5},
        {**base, "type": "se_e2_r", "sel": [20, 40], "neuron": [3, 6], "seed": 6},
        {**base, "sel": [14, 20], "type_one_side": False, "exclude_types": [[0, 1]], "seed": 7},
    ]
    descriptor = {"type": "hybrid", "list": members}
    fast = model_for(backend, descriptor)
    assert fast.sel == [20, 40] and fast.rcut == 3.5
    args = batch(fast, periodic)
    reference = model_for("reference", descriptor)
    assert_same(outputs_and_grads(fast, args), outputs_and_grads(reference, args), 1e-12, 1e-12)


def test_a_hybrid_runs_the_reference_unless_every_member_can_run_accelerated(monkeypatch):
    monkeypatch.delenv("MDTRAIN_BACKEND", raising=False)
    member = {"type": "se_e2_a", "sel": [10, 20], "rcut": 3.5, "neuron": [4, 8]}
    se_e3 = {"type": "se_e3", "sel": [4, 8], "rcut": 3.0, "neuron": [2, 4]}
    relu = {**member, "type": "se_e2_r", "activation_function": "relu"}
    for other, why in (
        (se_e3, "model.descriptor.list[1].type is 'se_e3' (accelerated: se_e2_a, se_e2_r, a"),
        (relu, "model.descriptor.list[1].activation_function is 'relu' (needs tanh)"),
    ):
        cfg = small_config()
        cfg["descriptor"] = {"type": "hybrid", "list": [member, other]}
        name, reason = choose_backend(normalize_model_config(cfg), torch.device("cpu"))
        assert name == "reference" and why in reason
    cfg["descriptor"]["list"][1] = {**member, "type": "se_e2_r"}
    assert build_model(cfg).backend == ("kernels" if _kernels_available() else "fused")


def test_radial_committee_evaluates_its_explicit_members_one_by_one():
    """The shared-environment committee (``accel.committee``) is se_e2_a's: se_e2_r members
    run as the reference committee, each on its own explicit forward."""
    configs = [small_config({"type": "se_e2_r", "sel": [20, 40], "seed": 1 + k}) for k in (0, 1)]
    committee = build_committee(configs, backend="fused")
    assert type(committee) is Committee and committee.backend == "fused"
    for member in committee.members:
        set_random_stats(member)
    args = batch(committee.members[0])
    outputs = committee.train()(*args)
    for member, out in zip(committee.members, outputs, strict=True):
        torch.testing.assert_close(out["force"], member(*args)["force"], rtol=0, atol=0)


def test_eval_mode_builds_no_graph_and_other_activations_use_autograd():
    model = model_for("fused", {"sel": [20, 40]}).eval()
    out = model(*batch(model))
    assert all(not v.requires_grad for v in out.values())
    relu = build_model(small_config({"sel": [20, 40]}, {"activation_function": "relu"}))
    assert relu.backend == "reference" and type(relu) is EnergyModel
    out = relu.train()(*batch(relu))
    assert out["force"].requires_grad


@pytest.mark.parametrize("backend", ACCELERATED)
def test_checkpoints_do_not_depend_on_the_backend(backend):
    fast = model_for(backend)
    reference = EnergyModel(small_config())
    state = fast.state_dict()
    assert list(state) == list(reference.state_dict())
    reference.load_state_dict(state)
    scripted = as_reference(fast)
    assert type(scripted) is EnergyModel and scripted.backend == "reference"
    args = batch(fast)
    torch.testing.assert_close(scripted(*args)["force"], fast(*args)["force"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_models_of_two_shapes_script_in_one_process():
    first = torch.jit.script(as_reference(model_for("reference", {"sel": [20, 40]})).eval())
    other = model_for("reference", {"sel": [8, 16], "neuron": [2, 4, 8]}, {"neuron": [8, 8]})
    second = torch.jit.script(other.eval())
    args = batch(other)
    torch.testing.assert_close(second(*args)["force"], other(*args)["force"])
    assert first(*batch(model_for("reference", {"sel": [20, 40]})))["energy"].shape == (2,)


@pytest.mark.parametrize("rows", [1024, 1023, 8])
def test_cross_product_split_in_halves_equals_one_product(rows):
    gen = torch.Generator().manual_seed(rows)
    left = torch.randn(rows, 25, generator=gen, dtype=torch.float64)
    right = torch.randn(rows, 50, generator=gen, dtype=torch.float64)
    start = torch.randn(25, 50, generator=gen, dtype=torch.float64)
    total = start.clone()
    add_cross_product(total, left, right)
    torch.testing.assert_close(total, start + left.t() @ right, rtol=1e-13, atol=1e-12)
