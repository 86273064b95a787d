"""The model against a brute-force numpy reimplementation of se_e2_a + fitting, plus
precision, initialisation and padded-slot behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.model import EnergyModel
from mdtrain.model.network import ResidualLayer
from tests.helpers.models import evaluate, make_model, small_config, triclinic, water_like
from tests.helpers.reference import ref_neighbours, ref_switch

# --------------------------------------------------------------------------------------------
# numpy reference


def ref_net(layers, x):
    for layer in layers:
        w = layer.weight.detach().double().numpy()
        b = layer.bias.detach().double().numpy()
        y = x @ w + b
        if layer.activation == "tanh":
            y = np.tanh(y)
        if layer.idt is not None:
            y = y * layer.idt.detach().double().numpy()
        if layer.skip == 1:
            y = y + x
        elif layer.skip == 2:
            y = y + np.concatenate([x, x], axis=-1)
        x = y
    return x


def ref_atom_energies(model: EnergyModel, coord, box, atype) -> np.ndarray:
    desc = model.descriptor
    davg, dstd = desc.davg.numpy(), desc.dstd.numpy()
    ntypes, sel, nnei = desc.ntypes, desc.sel, desc.nnei
    excluded = {tuple(p) for p in desc.exclude_types} | {
        tuple(reversed(p)) for p in desc.exclude_types
    }
    neigh = ref_neighbours(coord, box, atype, desc.rcut, sel)
    energies = []
    for i, blocks in enumerate(neigh):
        ti = atype[i]
        tmat = np.zeros((4, desc.neuron_out))
        slot = 0
        for t in range(ntypes):
            rows = np.zeros((sel[t], 4))
            for k, (r, d, _) in enumerate(blocks[t]):
                w = ref_switch(r, desc.rcut_smth, desc.rcut)
                rows[k] = w * np.array([1 / r, *(d / r**2)])
            rows = (rows - davg[ti, slot : slot + sel[t]]) / dstd[ti, slot : slot + sel[t]]
            for k, (_, _, tj) in enumerate(blocks[t]):
                if (ti, tj) in excluded:
                    rows[k] = 0.0
            net_index = t if desc.type_one_side else ti + t * ntypes
            g = ref_net(desc.networks[net_index].layers, rows[:, :1])
            tmat += rows.T @ g
            slot += sel[t]
        tmat /= nnei
        d = (tmat.T @ tmat[:, : desc.axis_neuron]).reshape(-1)
        e = ref_net(model.fitting.networks[ti].layers, d[None])[0, 0]
        energies.append(e + model.out_bias[ti].item())
    return np.array(energies)


CASES = {
    "one_side": {},
    "pairwise": {"type_one_side": False},
    "exclude": {"type_one_side": False, "exclude_types": [[0, 1]]},
    "exclude_same": {"exclude_types": [[1, 1]]},
    "davg_zero": {"set_davg_zero": True},
    "no_resnet_dt": {"resnet_dt": False},
    "small_sel": {"sel": [2, 3]},  # truncation to sel: nearest kept
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("periodic", [True, False])
def test_atom_energies_match_numpy_reference(case, periodic):
    model = make_model(CASES[case]).eval()
    box = triclinic(4.6, seed=3) if periodic else None
    coord, atype = water_like(3, box, seed=3)
    out = evaluate(model, coord, box, atype)
    ref = ref_atom_energies(model, coord, box, atype)
    np.testing.assert_allclose(out["atom_energy"], ref, rtol=1e-11, atol=1e-11)


def test_padding_feeds_the_embedding_and_exclusion_removes_pairs():
    """Padded slots contribute G(-davg/dstd), so the energy depends on sel even when every
    neighbour already fits; excluded pairs contribute nothing (not even a padded value)."""
    box = triclinic(4.6, seed=4)
    coord, atype = water_like(3, box, seed=4)
    e_small = evaluate(make_model({"sel": [12, 24]}).eval(), coord, box, atype)["energy"]
    e_big = evaluate(make_model({"sel": [16, 24]}).eval(), coord, box, atype)["energy"]
    assert abs(e_small - e_big) > 1e-6
    isolated = make_model({"exclude_types": [[0, 0], [0, 1], [1, 1]]}).eval()
    out = evaluate(isolated, coord, box, atype)
    assert np.abs(out["force"]).max() == 0.0 and np.abs(out["virial"]).max() == 0.0
    # every slot then holds 0 or the padded value: the lone atom (all padded) differs
    lone = evaluate(isolated, coord[:1], None, atype[:1])["atom_energy"]
    assert abs(out["atom_energy"][0] - lone[0]) > 1e-6


def test_float32_agrees_with_float64():
    cfg64 = small_config({"sel": [16, 32]})
    cfg32 = small_config({"sel": [16, 32], "precision": "float32"}, {"precision": "float32"})
    m64 = make_model({"sel": [16, 32]}).eval()
    m32 = EnergyModel(cfg32).eval()
    m32.load_state_dict(m64.state_dict())
    assert m32.descriptor.networks[0].layers[0].weight.dtype == torch.float32
    assert cfg64 != cfg32
    box = triclinic(5.0, seed=6)
    coord, atype = water_like(4, box, seed=6)
    a, b = evaluate(m64, coord, box, atype), evaluate(m32, coord, box, atype)
    assert b["energy"].dtype == np.float64 and b["force"].dtype == np.float64
    assert b["energy"] == pytest.approx(a["energy"], rel=1e-5)
    scale = np.abs(a["force"]).max()
    assert np.abs(a["force"] - b["force"]).max() < 1e-4 * scale
    assert np.abs(a["virial"] - b["virial"]).max() < 1e-4 * np.abs(a["virial"]).max()
    assert np.abs(a["force"] - b["force"]).max() > 0  # really computed in float32


def test_initialisation_distributions():
    torch.manual_seed(0)
    layer = ResidualLayer(300, 300, "tanh", True, True, torch.float64, seed=123)
    w, b, idt = layer.weight.detach(), layer.bias.detach(), layer.idt.detach()
    assert w.mean().abs() < 0.01 / 600**0.5 * 30
    assert w.std().item() == pytest.approx(1 / 600**0.5, rel=0.02)
    assert b.std().item() == pytest.approx(1.0, rel=0.15)
    assert idt.mean().item() == pytest.approx(0.1, abs=3e-4)
    assert idt.std().item() == pytest.approx(0.001, rel=0.2)
    # timestep only where a skip exists; no skip for 1 -> 4 or 64 -> 16
    model = EnergyModel(small_config({"resnet_dt": True}))
    layers = model.descriptor.networks[0].layers
    assert [ly.skip for ly in layers] == [0, 2, 2]
    assert layers[0].idt is None and layers[1].idt is not None
    fit = model.fitting.networks[0].layers
    assert [ly.skip for ly in fit] == [0, 1, 0] and fit[-1].activation == "linear"
    assert fit[1].idt is not None and fit[2].idt is None
    assert len(EnergyModel(small_config({"type_one_side": False})).descriptor.networks) == 4
