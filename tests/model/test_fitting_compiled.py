"""The compiled float32 fitting node (``fitting_compiled``) against the PyTorch node
(``fitting_node.fitting_with_grad``) run in float64 on the same parameters: energies, dE/dD,
and for a loss on both, dL/dD and every parameter's gradient, at float32 tolerance; on the
water shapes and on small odd ones (resnet_dt on and off, skips of both kinds, one type, a
type with no atoms, several frames, atoms not in type order, one cotangent missing). Which
node a model gets is chosen once, where it is built."""

import copy

import numpy as np
import pytest
import torch

from mdtrain.model.accel.fitting_compiled import CompiledFitting, fitting_node_for, supported
from mdtrain.model.accel.fitting_node import fitting_with_grad
from mdtrain.model.fitting import EnergyFitting

kernels_mod = pytest.importorskip("mdtrain.model.accel.kernels")


@pytest.fixture(scope="module")
def kernels():
    try:
        return kernels_mod.load_kernels()
    except RuntimeError as exc:
        pytest.skip(f"compiled kernels unavailable: {exc}")


def _pair(ntypes, dim, neuron, resnet_dt, seed=3):
    f64 = EnergyFitting(ntypes, dim, neuron, resnet_dt=resnet_dt, dtype=torch.float64, seed=seed)
    with torch.no_grad():  # idt away from its 0.1 start, so that its terms matter
        for p in f64.parameters():
            p.add_(0.05 * torch.randn_like(p))
    f32 = copy.deepcopy(f64).to(torch.float32)
    f32.dtype = torch.float32
    return f64, f32


def _run(node, fitting, d, atype, we, wg, use_e=True, use_g=True):
    d = d.detach().clone().requires_grad_(True)
    for p in fitting.parameters():
        p.grad = None
    energies, grad = node(fitting, d, atype)
    loss = 0.0
    if use_e:
        loss = loss + (energies * we).sum()
    if use_g:
        loss = loss + (grad.double() * wg).sum()
    loss.backward()
    return energies, grad, d.grad, [p.grad for p in fitting.parameters()]


def _close(a, b, what, tol=2e-4):
    assert (a is None) == (b is None), what
    if a is None:
        return
    a, b = a.double(), b.double()
    scale = b.abs().max().clamp_min(1e-30)
    err = (a - b).abs().max() / scale
    assert err < tol, f"{what}: relative error {err:.2e}"


CASES = [
    # ntypes, atom types, frames, dim, neuron, resnet_dt
    (2, [0] * 4 + [1] * 8, 1, 40, [24, 24, 24], True),  # the water layout, smaller
    (2, [1, 0, 1, 1, 0, 1, 0], 3, 13, [7, 7, 14], True),  # rows not in type order, skip 2
    (3, [2, 0, 2, 2, 0], 2, 9, [5, 10, 10], False),  # a type with no atoms, no idt
    (1, [0, 0, 0], 2, 6, [8], True),  # one type, one layer
    (2, [1, 1, 1, 1], 1, 5, [4, 4], True),  # type 0 absent
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("use", [(True, True), (True, False), (False, True)])
def test_compiled_matches_pytorch_float64(kernels, case, use):
    ntypes, atype, nf, dim, neuron, resnet_dt = case
    torch.manual_seed(7)
    f64, f32 = _pair(ntypes, dim, neuron, resnet_dt)
    assert supported(f32) and not supported(f64)
    atype = torch.tensor(atype)
    d = torch.randn(nf, len(atype), dim, dtype=torch.float64)
    we = torch.randn(nf, len(atype), dtype=torch.float64)
    wg = torch.randn(nf, len(atype), dim, dtype=torch.float64)
    ref = _run(fitting_with_grad, f64, d, atype, we, wg, *use)
    got = _run(CompiledFitting(kernels), f32, d.float(), atype, we, wg, *use)
    _close(got[0], ref[0], "energies")
    _close(got[1], ref[1], "dE/dD")
    _close(got[2], ref[2], "dL/dD")
    names = [n for n, _ in f64.named_parameters()]
    for name, a, b in zip(names, got[3], ref[3], strict=True):
        _close(a, b, name)


def test_water_shapes(kernels):
    torch.manual_seed(1)
    f64, f32 = _pair(2, 1600, [240, 240, 240], True)
    atype = torch.tensor([0] * 64 + [1] * 128)[torch.randperm(192)]
    d = torch.randn(1, 192, 1600, dtype=torch.float64) * 0.3
    we = torch.randn(1, 192, dtype=torch.float64)
    wg = torch.randn(1, 192, 1600, dtype=torch.float64)
    ref = _run(fitting_with_grad, f64, d, atype, we, wg)
    got = _run(CompiledFitting(kernels), f32, d.float(), atype, we, wg)
    for a, b, what in zip(got[:3], ref[:3], ["energies", "dE/dD", "dL/dD"], strict=True):
        _close(a, b, what, tol=5e-4)
    for (name, _), a, b in zip(f64.named_parameters(), got[3], ref[3], strict=True):
        _close(a, b, name, tol=5e-4)


def test_threads_agree(kernels):
    """One thread and two give the same values to float32 rounding (rows and columns split)."""
    torch.manual_seed(2)
    _, f32 = _pair(2, 30, [20, 20], True)
    atype = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1, 1])
    d = torch.randn(2, 9, 30, dtype=torch.float64)
    we, wg = torch.randn(2, 9, dtype=torch.float64), torch.randn(2, 9, 30, dtype=torch.float64)
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            runs.append(_run(CompiledFitting(kernels), f32, d.float(), atype, we, wg))
    finally:
        torch.set_num_threads(before)
    for other in runs[1:]:
        for a, b in zip([*runs[0][:3], *runs[0][3]], [*other[:3], *other[3]], strict=True):
            _close(a, b, "threads", tol=1e-5)


def test_float64_descriptor_is_cast(kernels):
    """A float64 D (a float64 descriptor with a float32 fitting) goes in cast, its gradient
    back through the cast, as with the PyTorch node."""
    torch.manual_seed(4)
    _, f32 = _pair(2, 12, [8, 8], True)
    atype = torch.tensor([1, 0, 1, 0, 1])
    d = torch.randn(2, 5, 12, dtype=torch.float64)
    we, wg = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, 12, dtype=torch.float64)
    node = CompiledFitting(kernels)
    ref = _run(node, f32, d.float(), atype, we, wg)
    got = _run(node, f32, d, atype, we, wg)
    assert got[2].dtype == torch.float64
    for a, b in zip([*got[:3], *got[3]], [*ref[:3], *ref[3]], strict=True):
        assert torch.equal(a.to(b.dtype), b)


def test_chosen_once(kernels):
    f64, f32 = _pair(2, 6, [4, 4], True)
    assert fitting_node_for(f64, kernels) is fitting_with_grad
    assert fitting_node_for(f32, None) is fitting_with_grad
    assert isinstance(fitting_node_for(f32, kernels), CompiledFitting)


def test_cast_after_choice_falls_back(kernels):
    """A fitting cast to float64 after its node was chosen runs the PyTorch node (the compiled
    one reads float32 parameters only), with the same bits as that node."""
    f64, f32 = _pair(2, 6, [4, 4], True)
    node = fitting_node_for(f32, kernels)
    f32.to(torch.float64)
    f32.dtype = torch.float64
    atype = torch.tensor([1, 0, 1])
    d = torch.randn(1, 3, 6, dtype=torch.float64)
    we, wg = torch.randn(1, 3, dtype=torch.float64), torch.randn(1, 3, 6, dtype=torch.float64)
    got = _run(node, f32, d, atype, we, wg)
    ref = _run(fitting_with_grad, f32, d, atype, we, wg)
    for a, b in zip([*got[:3], *got[3]], [*ref[:3], *ref[3]], strict=True):
        assert torch.equal(a, b)


def test_refuses_other_devices(kernels):
    _, f32 = _pair(2, 6, [4, 4], True)
    d = torch.empty(1, 3, 6, device="meta")
    with pytest.raises(RuntimeError, match="CPU tensors"):
        CompiledFitting(kernels)(f32, d, torch.tensor([1, 0, 1]))


def _model_inputs(model, nmol=6, frames=2):
    from mdtrain.neighbors.layout import layout_of
    from tests.helpers.models import water_like

    box = np.eye(3) * 7.0
    coords, nlists, shifts = [], [], []
    order = np.random.default_rng(0).permutation(3 * nmol)  # atoms not in type order
    for seed in range(frames):
        coord, atype = water_like(nmol, box, seed=seed)
        coord, atype = coord[order], atype[order]
        nlist, shift, _ = layout_of(model).build(coord, box, atype, model.rcut, model.sel)
        coords.append(coord)
        nlists.append(nlist)
        shifts.append(shift)
    stack = lambda xs: torch.tensor(np.stack(xs))  # noqa: E731
    boxes = torch.tensor(np.stack([box] * frames))
    return stack(coords), torch.tensor(atype), boxes, stack(nlists), stack(shifts)


def test_float32_kernels_model_gets_the_compiled_node(kernels):
    """Built once: float32 on the kernels gets the compiled node, float64 the PyTorch one; the
    whole model (two frames, atoms not in type order) gives the energies, forces and every
    parameter gradient of the same model on the PyTorch node, to float32 rounding."""
    from mdtrain.model.backend import build_model
    from tests.helpers.models import set_random_stats, small_config

    f64 = build_model(small_config(), backend="kernels")
    assert f64.fitting_node is fitting_with_grad
    cfg = small_config({"precision": "float32"}, {"precision": "float32"})
    model = set_random_stats(build_model(cfg, backend="kernels"))
    assert isinstance(model.fitting_node, CompiledFitting)
    inputs = _model_inputs(model)
    runs = []
    for node in (model.fitting_node, fitting_with_grad):
        model.fitting_node = node
        model.zero_grad(set_to_none=True)
        out = model(*inputs)
        (out["energy"].sum() + (out["force"] ** 2).sum()).backward()
        runs.append([out["energy"], out["force"], *(p.grad for p in model.parameters())])
    for a, b in zip(*runs, strict=True):
        _close(a, b, "model", tol=1e-4)
