"""The combined models (DP+ZBL, linear_ener, pairtab): forces and virials against finite
differences, each part's energies against the part evaluated alone on its own neighbour
list, and the builder's refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from mdtrain.model.backend import as_reference, build_model
from mdtrain.model.combined import zbl_switch
from mdtrain.model.combined_build import build_combined_model
from mdtrain.model.conservative import pair_vectors
from mdtrain.model.deepmd_file import read_dp, write_dp
from mdtrain.neighbors.nlist import build_nlist
from tests.helpers.finite_diff import fd_forces, fd_virial, rel_err
from tests.helpers.models import evaluate, set_random_stats, small_config, triclinic, water_like
from tests.helpers.pair_tables import write_table, zbl_table

SWITCH = {"sw_rmin": 0.8, "sw_rmax": 1.2, "smin_alpha": 0.1}


@pytest.fixture
def table(tmp_path):
    return write_table(tmp_path / "zbl.txt", zbl_table(["O", "H"], 0.2, 4.0, 0.02, zero_from=3.6))


def zbl_model(table, **switch):
    cfg = small_config(use_srtab=str(table), **{**SWITCH, **switch})
    model = build_combined_model(cfg)
    set_random_stats(model.parts[0])
    model.set_out_bias([-1.5, -0.7])
    return model


def frame(seed: int = 1):
    box = triclinic(5.2, seed=seed)
    coord, atype = water_like(3, box, seed=seed)
    return coord, box, atype


@pytest.mark.parametrize("periodic", [True, False])
def test_zbl_forces_and_virial_match_finite_differences(table, periodic):
    model = zbl_model(table)
    coord, box, atype = frame()
    box = box if periodic else None
    out = evaluate(model, coord, box, atype)
    assert rel_err(out["force"], fd_forces(model, coord, box, atype)) < 1e-6
    assert rel_err(out["virial"], fd_virial(model, coord, box, atype)) < 1e-6


def test_zbl_energy_is_the_switched_sum_of_its_parts(table):
    model = zbl_model(table)
    dp, part = model.parts
    coord, box, atype = frame()
    ours = evaluate(model, coord, box, atype)["atom_energy"]
    e_dp = evaluate(dp, coord, box, atype)["atom_energy"]
    nlist, shift, _ = build_nlist(coord, box, atype, dp.rcut, [sum(dp.sel)] * 2)
    nl, sh = torch.tensor(nlist)[None], torch.tensor(shift)[None]
    diff = pair_vectors(torch.tensor(coord)[None], torch.tensor(box)[None], nl, sh)
    e_tab = part.atomic_energy(diff, nl, torch.tensor(atype))[0].numpy()
    s = zbl_switch(diff, nl, **{k: SWITCH[k] for k in ("sw_rmin", "sw_rmax")}, alpha=0.1)
    s = s[0].numpy()
    assert np.any((s > 0) & (s < 1))  # the frame lies in the switching region
    expected = (1 - s) * e_dp + s * e_tab + np.array([-1.5, -0.7])[atype]
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-12)


def linear_config(table, weights):
    near = small_config(descriptor={"rcut": 2.5, "sel": [6, 12], "seed": 5})
    far = small_config(descriptor={"seed": 7})
    pairtab = {"type": "pairtab", "tab_file": str(table), "rcut": 4.0, "sel": 60}
    return {
        "type": "linear_ener",
        "type_map": ["O", "H"],
        "models": [near, far, pairtab],
        "weights": weights,
    }


@pytest.mark.parametrize(
    "weights, expected",
    [("sum", [1, 1, 1]), ("mean", [1 / 3] * 3), ([0.5, -2.0, 0.25], [0.5, -2.0, 0.25])],
)
def test_linear_energy_is_the_weighted_sum_of_parts_on_their_own_lists(table, weights, expected):
    model = build_combined_model(linear_config(table, weights))
    for k in (0, 1):
        set_random_stats(model.parts[k], seed=k)
    assert model.rcut == 4.0 and model.sel == [60, 60]
    coord, box, atype = frame(seed=2)
    ours = evaluate(model, coord, box, atype)
    total = np.zeros(len(atype))
    for w, part in zip(expected, model.parts):
        if hasattr(part, "descriptor"):
            alone = evaluate(part, coord, box, atype)["atom_energy"]
        else:
            pairtab = build_combined_model(
                {**linear_config(table, "sum")["models"][2], "type_map": ["O", "H"]}
            )
            alone = evaluate(pairtab, coord, box, atype)["atom_energy"]
        assert np.abs(alone).max() > 1e-3
        total += w * alone
    np.testing.assert_allclose(ours["atom_energy"], total, rtol=1e-12, atol=1e-12)
    assert rel_err(ours["force"], fd_forces(model, coord, box, atype)) < 1e-6


def test_pairtab_keeps_the_nearest_sel_neighbours_of_any_type(table):
    cfg = {"type": "pairtab", "type_map": ["O", "H"], "tab_file": str(table), "rcut": 4.0, "sel": 5}
    model = build_combined_model(cfg)
    coord, box, atype = frame(seed=3)
    ours = evaluate(model, coord, box, atype)["atom_energy"]
    part = model.parts[0]
    nlist, shift, _ = build_nlist(coord, box, atype, 4.0, [60, 60])
    d = np.linalg.norm(coord[np.clip(nlist, 0, None)] + shift @ box - coord[:, None], axis=-1)
    d = np.where(nlist >= 0, d, np.inf)
    expected = []
    for i in range(len(atype)):
        keep = np.argsort(d[i])[:5]
        r = torch.tensor(d[i][keep])
        tj = torch.tensor(atype[nlist[i][keep]])
        e = part.pair_energy(r, torch.tensor(atype[i]), tj, torch.isfinite(r))
        expected.append(0.5 * float(e.sum()))
    assert np.count_nonzero(np.isfinite(d).sum(-1) > 5) > 0  # truncation happens
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"weights": [1.0]}, 'model/weights: "sum", "mean" or a list of 3 numbers'),
        ({"weights": None}, "model/weights"),
        ({"models": []}, "model/models: a non-empty list"),
    ],
)
def test_linear_builder_refusals(table, change, message):
    with pytest.raises(MDTrainError, match=message):
        build_combined_model({**linear_config(table, "sum"), **change})


def test_zbl_builder_refusals(table, tmp_path):
    with pytest.raises(MDTrainError, match="sw_rmax: 0.5 must be greater than sw_rmin 0.8"):
        zbl_model(table, sw_rmax=0.5)
    with pytest.raises(MDTrainError, match="model/sw_rmin: a number is required"):
        build_combined_model(small_config(use_srtab=str(table), sw_rmax=1.0))
    other = write_table(tmp_path / "three.txt", zbl_table(["O", "H", "C"], 0.2, 4.0, 0.1))
    with pytest.raises(MDTrainError, match=r"model/use_srtab .*three.txt: has 6 energy columns"):
        zbl_model(other)
    sub = {**linear_config(table, "sum")}
    sub["models"][0]["type_map"] = ["H", "O"]
    with pytest.raises(MDTrainError, match=r"model/models/0/type_map"):
        build_combined_model(sub)


def test_relative_table_path_is_read_from_the_input_folder(table):
    cfg = {
        "type": "pairtab",
        "type_map": ["O", "H"],
        "tab_file": table.name,
        "rcut": 4.0,
        "sel": 20,
    }
    model = build_combined_model(cfg, base_dir=table.parent)
    assert model.get_model_config()["tab_file"] == str(table.resolve())
    with pytest.raises(MDTrainError, match="no such file"):
        build_combined_model(cfg, base_dir=table.parent / "elsewhere")


def test_model_rebuilds_from_its_config_without_the_table_file(table):
    model = build_combined_model(linear_config(table, [0.5, 1.0, 2.0]))
    for k in (0, 1):
        set_random_stats(model.parts[k], seed=k)
    model.set_out_bias([0.3, -0.2])
    coord, box, atype = frame(seed=4)
    before = evaluate(model, coord, box, atype)["atom_energy"]
    config, state = model.get_model_config(), model.state_dict()
    table.unlink()
    rebuilt = build_combined_model(config)
    rebuilt.load_state_dict(state)
    np.testing.assert_array_equal(evaluate(rebuilt, coord, box, atype)["atom_energy"], before)


@pytest.mark.parametrize("kind", ["zbl", "linear_ener"])
def test_dp_file_round_trip(table, tmp_path, kind):
    if kind == "zbl":
        model = zbl_model(table)
    else:
        model = build_combined_model(linear_config(table, "mean"))
        for k in (0, 1):
            set_random_stats(model.parts[k], seed=k)
        model.set_out_bias([0.3, -0.2])
    write_dp(model, tmp_path / "model.dp")
    data = read_dp(tmp_path / "model.dp")
    assert data["model"]["type"] == kind
    assert data["model"]["models"][-1]["type"] == "pairtab"
    assert "table_rows" not in json.dumps(data["model_def_script"])
    loaded = load_model(tmp_path / "model.dp")
    assert type(loaded) is type(model)
    coord, box, atype = frame(seed=5)
    ours, theirs = evaluate(model, coord, box, atype), evaluate(loaded, coord, box, atype)
    for key in ("atom_energy", "force", "virial"):
        np.testing.assert_array_equal(theirs[key], ours[key])


def test_backends_other_than_reference_are_refused(table):
    cfg = small_config(use_srtab=str(table), **SWITCH)
    assert build_model(cfg).backend == "reference"
    with pytest.raises(MDTrainError, match="runs on 'reference'"):
        build_model(cfg, backend="fused")
    model = build_model(cfg)
    assert as_reference(model) is model  # freezing scripts it as it is


def test_a_mixed_part_gets_its_nearest_neighbours_first_padded_to_its_sel(table):
    cfg = {"type": "pairtab", "type_map": ["O", "H"], "tab_file": str(table), "rcut": 3.0}
    model = build_combined_model({**cfg, "sel": 70})
    coord, box, atype = frame(seed=6)
    nlist, shift, _ = build_nlist(coord, box, atype, model.rcut, model.sel)
    nl, sh = torch.tensor(nlist)[None], torch.tensor(shift)[None]
    diff = pair_vectors(torch.tensor(coord)[None], torch.tensor(box)[None], nl, sh)
    dist = torch.where(nl >= 0, diff.norm(dim=-1), torch.full_like(diff[..., 0], float("inf")))
    sub_diff, sub_nlist = model.part_list(0, diff, nl, dist)
    assert sub_nlist.shape[-1] == 70
    r = torch.where(sub_nlist >= 0, sub_diff.norm(dim=-1), torch.full_like(sub_diff[..., 0], 1e9))
    assert torch.all(r[..., 1:] >= r[..., :-1])  # nearest first, padding last
    assert int((sub_nlist >= 0).sum()) == int(((dist < 3.0) & (nl >= 0)).sum())
    assert float(r[sub_nlist >= 0].max()) < 3.0
