"""The compiled environment matrix and force path (``mdtrain.model.accel.pair_kernels``, the
``kernels`` backend's) against the PyTorch nodes they replace (``environment_node``,
``force_node``): the same bits in both precisions, forward and backward, for every row kind and
setting, on one and on two threads; the backward against finite differences (gradcheck)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from mdtrain.model.accel.force_node import forces_and_virial
from mdtrain.model.accel.kernels import load_kernels
from mdtrain.model.accel.pair_kernels import CompiledPairs
from mdtrain.model.backend import build_model
from tests.helpers.models import batch, set_random_stats, small_config

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler"
)

TYPES = {"se_e2_a": {}, "se_e2_r": {"type": "se_e2_r"}}
SETTINGS = {
    "one_side": {},
    "pairwise": {"type_one_side": False},
    "exclude": {"type_one_side": False, "exclude_types": [[0, 1]], "env_protection": 0.3},
}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and dtypes, signed zeros included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def _environments(kind: str, setting: str, precision: str, nmol: int):
    config = small_config({"sel": [8, 13], **TYPES[kind], **SETTINGS[setting]})
    config["descriptor"]["precision"] = config["fitting_net"]["precision"] = precision
    model = set_random_stats(build_model(config, backend="fused"))
    coord, atype, box, nlist, shift = batch(model, True, nmol=nmol)
    diff = model.pair_vectors(coord, box, nlist, shift)
    torch_env = model.form.environment(model.descriptor, diff, nlist, atype)
    pairs = CompiledPairs(load_kernels())
    return torch_env, model.form.environment(model.descriptor, diff, nlist, atype, pairs=pairs)


def _force_outputs(env, pieces, members):
    """Forces, virials and the pieces' gradients of three losses (forces and virial, each)."""
    ps = [p.clone().requires_grad_(True) for p in pieces]
    force, virial = forces_and_virial(env.force, ps, members)
    gen = torch.Generator().manual_seed(5)
    f_w = torch.randn(force.shape, generator=gen, dtype=force.dtype)
    v_w = torch.randn(virial.shape, generator=gen, dtype=virial.dtype)
    out = [force.detach(), virial.detach()]
    f_loss, v_loss = (force * f_w).sum(), (virial * v_w).sum()
    for loss in (f_loss + v_loss, f_loss, v_loss):
        out += torch.autograd.grad(loss, ps, retain_graph=True)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", TYPES)
def test_compiled_pairs_bit_identical_to_the_torch_nodes(kind, setting, precision, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for nmol in (1, 3):  # 63 and 189 slots per frame: vector loops and their tails
            plain, compiled = _environments(kind, setting, precision, nmol)
            assert compiled.force.pairs is not None and plain.force.pairs is None
            for name in ("far", "coef", "scale", "planes"):
                assert _bits_equal(getattr(plain.force, name), getattr(compiled.force, name))
            assert torch.equal(plain.pad, compiled.pad)
            for a, b in zip(plain.groups, compiled.groups, strict=True):
                for name in ("rows", "cols", "mask"):
                    assert _bits_equal(getattr(a, name), getattr(b, name)), name
                assert a.widths == b.widths
            width = plain.force.scale.shape[-1]
            for members in (1, 2):
                gen = torch.Generator().manual_seed(3)
                pieces = [
                    torch.randn(*g.rows.shape[:2], width, generator=gen, dtype=g.rows.dtype)
                    for _ in range(members)
                    for g in plain.groups
                ]
                expected = _force_outputs(plain, pieces, members)
                got = _force_outputs(compiled, pieces, members)
                assert all(_bits_equal(a, b) for a, b in zip(expected, got, strict=True))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", TYPES)
def test_compiled_pairs_backwards_by_finite_differences(kind):
    config = small_config({"sel": [8, 13], **TYPES[kind], **SETTINGS["exclude"]})
    model = set_random_stats(build_model(config, backend="kernels"))
    coord, atype, box, nlist, shift = batch(model, True, nmol=2)
    diff = model.pair_vectors(coord, box, nlist, shift)
    compiled = model.form.environment(model.descriptor, diff, nlist, atype)
    pairs, plan = compiled.force.pairs, compiled.force.plan
    nl = nlist.reshape(-1, nlist.shape[-1]).index_select(0, plan.centre)

    def rows(vectors):
        (r, c, *_), _ = pairs.environment(
            model.descriptor, compiled.force.kind, vectors, nl, plan.types, atype, kind != "se_e2_a"
        )
        return r, c

    vectors = plan.vectors.clone().requires_grad_(True)
    torch.autograd.gradcheck(rows, (vectors,), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)
    width = compiled.force.scale.shape[-1]
    gen = torch.Generator().manual_seed(3)
    pieces = tuple(
        torch.randn(*g.rows.shape[:2], width, generator=gen, dtype=torch.float64).requires_grad_()
        for _ in range(2)
        for g in compiled.groups
    )

    def node(*ps):
        return forces_and_virial(compiled.force, list(ps), 2)

    torch.autograd.gradcheck(node, pieces, eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=True)


def test_kernels_backend_runs_the_compiled_pairs():
    model = set_random_stats(build_model(small_config({"sel": [8, 13]}), backend="kernels"))
    coord, atype, box, nlist, shift = batch(model, True, nmol=2)
    diff = model.pair_vectors(coord, box, nlist, shift)
    env = model.form.environment(model.descriptor, diff, nlist, atype)
    assert isinstance(env.force.pairs, CompiledPairs)
    fused = build_model(small_config({"sel": [8, 13]}), backend="fused")
    assert fused.form.environment(fused.descriptor, diff, nlist, atype).force.pairs is None
