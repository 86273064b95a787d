"""The explicit backends' environment-matrix node and force node
(``mdtrain.model.accel.environment_node``, ``force_node``): their backwards against finite
differences (gradcheck), their forwards against the reference's environment matrix and
plain autograd of the same sums, (whole models against the reference: ``test_backends``, a
type missing from the frames included: ``test_backends``) against the reference."""

from __future__ import annotations

import pytest
import torch

from mdtrain.model.accel.environment_node import as_planes, as_rows, environment_matrix
from mdtrain.model.accel.force_node import forces_and_virial
from mdtrain.model.backend import build_model
from tests.helpers.models import batch, set_random_stats, small_config

TYPES = {"se_e2_a": {}, "se_e2_r": {"type": "se_e2_r"}}

SETTINGS = {
    "one_side": {},
    "pairwise": {"type_one_side": False},
    "exclude": {"type_one_side": False, "exclude_types": [[0, 1]], "env_protection": 0.3},
}


def _environment(kind: str, setting: str, periodic: bool = True):
    """A small model, its batch and the environment its explicit form computes."""
    config = small_config({"sel": [8, 12], **TYPES[kind], **SETTINGS[setting]})
    model = set_random_stats(build_model(config, backend="fused"))
    coord, atype, box, nlist, shift = batch(model, periodic, nmol=2)
    diff = model.pair_vectors(coord, box, nlist, shift)
    env = model.form.environment(model.descriptor, diff, nlist, atype)
    return model, env, nlist, atype


def _lists(env, nlist):
    """The lists in the environment's group order."""
    flat = nlist.reshape(-1, nlist.shape[-1])
    return flat.index_select(0, env.force.plan.centre)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", TYPES)
def test_environment_node_rows_and_their_derivative(kind, setting):
    model, env, nlist, atype = _environment(kind, setting)
    desc, plan, nl = model.descriptor, env.force.plan, _lists(env, nlist)
    assert (nl < 0).any() and (nl >= 0).any()  # padded slots and real ones

    def rows(vectors):
        return environment_matrix(desc, env.force.kind, vectors, nl, plan.types, atype)[0][0]

    vectors = plan.vectors.clone().requires_grad_(True)
    torch.autograd.gradcheck(rows, (vectors,), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)
    # the rows are the reference descriptor's environment matrix, normalised
    mask = nl >= 0
    expected = (desc.env_matrix(plan.vectors, mask) - desc.davg[plan.types]) / desc.dstd[plan.types]
    if desc.has_exclusions:
        neighbour = torch.where(mask, atype[nl.clamp(min=0)], desc.ntypes)
        expected = expected * desc.pair_keep[plan.types.unsqueeze(-1), neighbour].unsqueeze(-1)
    assert expected.abs().max() > 0
    torch.testing.assert_close(rows(plan.vectors), expected, rtol=1e-13, atol=1e-13)


def _plain_forces(env, pieces, members):
    """The force node's sums as plain operations (autograd differentiates them)."""
    inputs, plan = env.force, env.force.plan
    rows, nnei = plan.centre.shape[0], plan.vectors.shape[1]  # g: (K, M, nnei, 3)
    q = torch.cat(pieces).view(members, rows, nnei, -1) * inputs.scale
    g = as_rows(inputs.kind.pull(as_planes(q), inputs.far, inputs.coef)).to(torch.float64)
    flat = plan.nf * plan.natoms
    force = torch.zeros(members, flat, 3, dtype=torch.float64)
    force = force.index_add(1, plan.centre, g.sum(dim=2))
    force = force.index_add(1, plan.neighbour, g.reshape(members, -1, 3), alpha=-1.0)
    frame = torch.div(plan.centre, plan.natoms, rounding_mode="floor")
    per_row = torch.einsum("kmna,mnb->kmab", g, plan.vectors)
    virial = -torch.zeros(members, plan.nf, 3, 3, dtype=torch.float64).index_add(1, frame, per_row)
    return force.view(members, plan.nf, plan.natoms, 3), virial


@pytest.mark.parametrize("members", [1, 2])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", TYPES)
def test_force_node_against_plain_autograd_and_finite_differences(kind, setting, members):
    _, env, _, _ = _environment(kind, setting)
    width = env.force.scale.shape[-1]
    gen = torch.Generator().manual_seed(3)
    pieces = [
        torch.randn(
            g.rows.shape[0], g.rows.shape[1], width, generator=gen, dtype=torch.float64
        ).requires_grad_(True)
        for _ in range(members)
        for g in env.groups
    ]
    force, virial = forces_and_virial(env.force, pieces, members)
    plain_force, plain_virial = _plain_forces(env, pieces, members)
    torch.testing.assert_close(force, plain_force, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(virial, plain_virial, rtol=1e-13, atol=1e-12)
    weights = torch.randn(force.shape, generator=gen, dtype=torch.float64)
    v_weights = torch.randn(virial.shape, generator=gen, dtype=torch.float64)
    for f_w, v_w in ((weights, v_weights), (weights, None), (None, v_weights)):

        def loss(f, v, f_w=f_w, v_w=v_w):
            total = f.new_zeros(())
            if f_w is not None:
                total = total + (f * f_w).sum()
            if v_w is not None:
                total = total + (v * v_w).sum()
            return total

        grads = torch.autograd.grad(loss(force, virial), pieces, retain_graph=True)
        expected = torch.autograd.grad(loss(plain_force, plain_virial), pieces, retain_graph=True)
        for a, b in zip(grads, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    def node(*ps):
        return forces_and_virial(env.force, list(ps), members)

    torch.autograd.gradcheck(node, tuple(pieces), eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=True)
