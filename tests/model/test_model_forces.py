"""Forces and virials against central finite differences (neighbour list rebuilt each time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.finite_diff import fd_forces, fd_virial, rel_err
from tests.helpers.models import (
    evaluate,
    make_model,
    triclinic,
    water_like,
)


def frames():
    # periodic triclinic cell shorter than 2·rcut (rcut 3.5)
    box = triclinic(5.2, seed=1)
    coord, atype = water_like(3, box, seed=1)
    yield "triclinic", coord, box, atype
    # cell shorter than rcut: atoms see several images of themselves and of each other
    box = triclinic(2.6, seed=2)
    coord = np.array([[0.1, 0.2, 0.3], [1.2, 0.9, 1.4], [0.4, 1.6, 0.8]])
    yield "tiny", coord, box, np.array([0, 1, 1])
    # non-periodic cluster
    coord, atype = water_like(3, None, seed=3)
    yield "nopbc", coord, None, atype


FRAMES = list(frames())


@pytest.mark.parametrize("name, coord, box, atype", FRAMES, ids=[f[0] for f in FRAMES])
@pytest.mark.parametrize("type_one_side", [True, False])
def test_forces_and_virial_match_finite_differences(name, coord, box, atype, type_one_side):
    model = make_model({"type_one_side": type_one_side, "sel": [16, 32]}).eval()
    out = evaluate(model, coord, box, atype)
    assert np.abs(out["force"]).max() > 1e-3  # a non-trivial check
    assert rel_err(out["force"], fd_forces(model, coord, box, atype)) < 1e-6
    assert rel_err(out["virial"], fd_virial(model, coord, box, atype)) < 1e-6
    assert out["energy"] == pytest.approx(out["atom_energy"].sum(), rel=1e-14)


def test_virial_convention_is_sum_of_force_times_position_without_pbc():
    """Without images, DeePMD's virial[k][j] = Σ_i F_ik x_ij exactly."""
    coord, atype = water_like(3, None, seed=4)
    model = make_model().eval()
    out = evaluate(model, coord, None, atype)
    direct = np.einsum("ik,ij->kj", out["force"], coord)
    np.testing.assert_allclose(out["virial"], direct, atol=1e-10)
    assert np.abs(out["force"].sum(axis=0)).max() < 1e-10  # no net force


def test_training_mode_builds_second_order_graph():
    """d(Σ F²)/dθ from double backward agrees with finite differences in one parameter."""
    box = triclinic(5.0, seed=5)
    coord, atype = water_like(2, box, seed=5)
    model = make_model().train()
    from mdtrain.neighbors.nlist import build_nlist

    nlist, shift, _ = build_nlist(coord, box, atype, model.rcut, model.sel)
    args = (
        torch.tensor(coord)[None],
        torch.tensor(atype),
        torch.tensor(box)[None],
        torch.tensor(nlist)[None],
        torch.tensor(shift)[None],
    )

    def loss_fn():
        out = model(*args)
        return (out["force"] ** 2).sum() + (out["virial"] ** 2).sum()

    loss = loss_fn()
    assert loss.requires_grad
    loss.backward()
    for param in (
        model.descriptor.networks[1].layers[1].weight,
        model.fitting.networks[0].layers[0].bias,
    ):
        flat = param.grad.reshape(-1)
        k = int(flat.abs().argmax())
        grad = flat[k].item()
        h = 1e-4
        with torch.no_grad():
            param.view(-1)[k] += h
        lp = loss_fn().item()
        with torch.no_grad():
            param.view(-1)[k] -= 2 * h
        lm = loss_fn().item()
        with torch.no_grad():
            param.view(-1)[k] += h
        assert grad == pytest.approx((lp - lm) / (2 * h), rel=1e-6)


def test_eval_under_no_grad_returns_detached_outputs():
    coord, atype = water_like(2, None, seed=6)
    model = make_model().eval()
    with torch.no_grad():
        out = evaluate(model, coord, None, atype)  # forces still computed
    assert np.abs(out["force"]).max() > 0


def test_atom_exclude_types_zero_their_energy_but_keep_forces_exact():
    box = triclinic(5.0, seed=7)
    coord, atype = water_like(3, box, seed=7)
    model = make_model({"sel": [16, 32]}, atom_exclude_types=[1]).eval()
    out = evaluate(model, coord, box, atype)
    assert np.all(out["atom_energy"][atype == 1] == 0) and np.all(
        out["atom_energy"][atype == 0] != 0
    )
    assert rel_err(out["force"], fd_forces(model, coord, box, atype)) < 1e-6
