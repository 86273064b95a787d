"""The battery every registered descriptor runs (parametrised over the registry, so a new
descriptor cannot skip it): forces and virials against finite differences, invariances,
extensivity, float32, periodic and not, exclusions, statistics from pairs against the padded
lists, a restart, TorchScript and the calculator; and the backend ``build_model`` chooses
(accelerated where the descriptor has an explicit form) against the reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model import EnergyModel
from mdtrain.model.backend import ACCELERATED_DESCRIPTORS, build_model
from mdtrain.model.config import normalize_model_config
from mdtrain.model.conservative import pair_vectors
from mdtrain.model.descriptors import DESCRIPTORS, canonical_type
from mdtrain.model.stats import collect_stat_batches, stat_batch_plan, stream_stat_inputs
from mdtrain.neighbors.layout import layout_of
from mdtrain.schema import discriminator_values, load_schema, resolve
from tests.helpers.descriptor_battery import (
    BATTERY,
    battery_cases,
    battery_config,
    case_id,
    layout_cases,
)
from tests.helpers.models import (
    batch,
    evaluate,
    set_random_stats,
    strained,
    triclinic,
    water_like,
)
from tests.helpers.padded_stats import descriptor_stat_items
from tests.helpers.stat_systems import make_system

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*deprecated:DeprecationWarning")

CASES = battery_cases()
IDS = [case_id(c) for c in CASES]
NAMED = layout_cases()
NAMED_IDS = [case_id(c) for c in NAMED]
H = 1e-5


def model_of(case, **descriptor) -> EnergyModel:
    name, variant = case
    return set_random_stats(EnergyModel(battery_config(name, variant, **descriptor))).eval()


def frame(periodic: bool, seed: int = 1, nmol: int = 3):
    box = triclinic(5.2, seed=seed) if periodic else None
    coord, atype = water_like(nmol, box, seed=seed)
    return coord, box, atype


def energy(model, coord, box, atype) -> float:
    return float(evaluate(model, coord, box, atype)["energy"])


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_every_descriptor_has_battery_settings_and_a_schema_section():
    schema = load_schema()
    branches = [resolve(b, schema) for b in schema["$defs"]["descriptor"]["anyOf"]]
    in_schema = {discriminator_values(b, "type")[0]: b for b in branches}
    assert set(in_schema) == set(DESCRIPTORS) == set(BATTERY)
    for name, cls in DESCRIPTORS.items():
        accepted = discriminator_values(in_schema[name], "type")
        assert accepted == [name, *cls.aliases]
        keys = set(in_schema[name]["properties"])
        has_sel = {"sel"} if cls.members_key is None else set()  # a hybrid's members have it
        assert keys == set(cls.defaults) | has_sel, name  # every key, DeePMD-kit's defaults
        for key, value in cls.defaults.items():
            assert in_schema[name]["properties"][key].get("default", value) == value, key
        for alias in cls.aliases:
            assert canonical_type(alias) == name


def test_the_config_layers_mixed_types_list_agrees_with_the_registry():
    """``mdtrain.config.mixed_types`` (read by check, neighbor-stat and the sel rules without
    importing the models) names exactly the registered descriptors with a type-mixed list,
    by every name and alias, and the model's list layout follows it."""
    from mdtrain.config.mixed_types import MIXED_TYPES_DESCRIPTORS, mixed_types
    from mdtrain.neighbors.layout import MIXED, PER_TYPE, layout_of

    mixed = [c for c in DESCRIPTORS.values() if getattr(c, "mixed_types", False)]
    names = {n for cls in mixed for n in (cls.type_name, *cls.aliases)}
    assert set(MIXED_TYPES_DESCRIPTORS) == names
    for name, cls in DESCRIPTORS.items():
        for alias in (name, *cls.aliases):
            assert mixed_types({"type": alias}) == bool(getattr(cls, "mixed_types", False))
        model = EnergyModel(battery_config(name))
        assert model.mixed_types == bool(getattr(cls, "mixed_types", False))
        assert layout_of(model) is (MIXED if model.mixed_types else PER_TYPE)
        assert model.sel == ([sum(model.sel)] if model.mixed_types else model.sel)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_fitting_follows_the_descriptor_as_in_deepmd_kit(case):
    """DeePMD-kit builds ONE fitting net for all types after a type-mixed descriptor (its
    fitting ``mixed_types`` is the descriptor's ``mixed_types()``; a hybrid's is any
    member's), one per type otherwise; the energy bias stays per type. Atomic energies are
    recomputed here from the descriptor, net by net."""
    model = model_of(case)
    cls = DESCRIPTORS[case[0]]
    desc = battery_config(*case)["descriptor"]
    members = [DESCRIPTORS[canonical_type(m["type"])] for m in desc.get("list", [])]
    shared = any(getattr(c, "mixed_types", False) for c in [cls, *members])
    assert model.fitting.mixed_types is shared
    assert len(model.fitting.networks) == (1 if shared else model.ntypes)
    coord, box, atype = frame(True, seed=4)
    nlist, shift, _ = layout_of(model).build(coord, box, atype, model.rcut, model.sel)
    x = torch.tensor(coord)[None]
    diff = pair_vectors(
        x, torch.tensor(box)[None], torch.tensor(nlist)[None], torch.tensor(shift)[None]
    )
    with torch.no_grad():
        d = model.descriptor(diff, torch.tensor(nlist)[None], torch.tensor(atype))[0]
        got = model.atomic_energy(diff, torch.tensor(nlist)[None], torch.tensor(atype))[0]
        for i, t in enumerate(atype):
            net = model.fitting.networks[0 if shared else int(t)]
            want = net(d[i : i + 1].to(model.fitting.dtype))[0, 0] + model.out_bias[t]
            assert float(got[i]) == pytest.approx(float(want), rel=1e-12, abs=1e-12)


def test_unknown_and_unimplemented_types_name_the_supported_ones():
    for bad, what in (("se_bogus", "not a descriptor type"), ("dpa2", "not implemented")):
        with pytest.raises(MDTrainError, match=what) as info:
            normalize_model_config(battery_config("se_e2_a", type=bad))
        assert "se_e2_a (alias se_a)" in str(info.value) and "\n" not in str(info.value)


def energies(model, frames, atype) -> np.ndarray:
    """The energies of many frames of one system (``(coord, box)`` pairs), each with its own
    freshly built list, in one batched evaluation: the displaced copies of a
    finite-difference check cost one forward instead of one each."""
    lists = [layout_of(model).build(c, b, atype, model.rcut, model.sel) for c, b in frames]
    boxes = [b for _, b in frames]
    out = model(
        torch.tensor(np.stack([c for c, _ in frames])),
        torch.tensor(atype),
        None if boxes[0] is None else torch.tensor(np.stack(boxes)),
        torch.tensor(np.stack([nl for nl, _, _ in lists])),
        torch.tensor(np.stack([sh for _, sh, _ in lists])),
    )
    return out["energy"].detach().numpy().reshape(len(frames))


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("periodic", [True, False], ids=["pbc", "nopbc"])
def test_forces_and_virial_match_finite_differences(case, periodic):
    model = model_of(case)
    coord, box, atype = frame(periodic)
    out = evaluate(model, coord, box, atype)
    assert np.abs(out["force"]).max() > 1e-4  # a non-trivial check
    frames = []  # each coordinate moved by +H, then -H; then each strain +H, -H
    for i in range(len(coord)):
        for k in range(3):
            for sign in (1, -1):
                moved = coord.copy()
                moved[i, k] += sign * H
                frames.append((moved, box))
    for a in range(3):
        for b in range(3):
            eps = np.zeros((3, 3))
            eps[a, b] = H
            frames += [strained(coord, box, eps), strained(coord, box, -eps)]
    e = energies(model, frames, atype)
    fd = -(e[0 : coord.size * 2 : 2] - e[1 : coord.size * 2 : 2]).reshape(coord.shape) / (2 * H)
    assert rel_err(out["force"], fd) < 1e-6
    dE = ((e[coord.size * 2 :: 2] - e[coord.size * 2 + 1 :: 2]) / (2 * H)).reshape(3, 3)
    assert rel_err(out["virial"], -dE.T) < 1e-6
    assert out["energy"] == pytest.approx(out["atom_energy"].sum(), rel=1e-13)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("periodic", [True, False], ids=["pbc", "nopbc"])
def test_the_chosen_backend_trains_as_the_reference(case, periodic):
    """The model ``build_model`` builds (an accelerated backend for the descriptors it has an
    explicit form of, and a hybrid of them) gives the reference's energies, forces and virials, and the parameter
    gradients of a loss on all of them, to 1e-12 in float64."""
    reference = model_of(case).train()
    chosen = build_model(reference.get_model_config()).train()
    chosen.load_state_dict(reference.state_dict())
    # a hybrid is accelerated when all its members are
    kinds = [m["type"] for m in chosen.get_model_config()["descriptor"].get("list", [])]
    accelerated = all(k in ACCELERATED_DESCRIPTORS for k in kinds or [case[0]])
    assert (chosen.backend != "reference") == accelerated
    args = batch(reference, periodic)
    results = []
    for model in (chosen, reference):
        model.zero_grad()
        out = model(*args)
        loss = (out["energy"] ** 2).sum() + (out["force"] ** 2).sum() + (out["virial"] ** 2).sum()
        loss.backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
        results.append(([out[k].detach() for k in ("energy", "force", "virial")], grads))
    for a, b in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * max(1.0, b.abs().max()))
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * max(1.0, b.abs().max()))


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("periodic", [True, False], ids=["pbc", "nopbc"])
def test_rotation_translation_and_permutation_invariance(case, periodic):
    model = model_of(case)
    coord, box, atype = frame(periodic, seed=2)
    ref = evaluate(model, coord, box, atype)
    rot = np.linalg.qr(np.random.default_rng(3).normal(size=(3, 3)))[0]
    out = evaluate(model, coord @ rot, None if box is None else box @ rot, atype)
    assert out["energy"] == pytest.approx(ref["energy"], rel=1e-12)
    np.testing.assert_allclose(out["force"], ref["force"] @ rot, atol=1e-10)
    np.testing.assert_allclose(out["virial"], rot.T @ ref["virial"] @ rot, atol=1e-10)
    out = evaluate(model, coord + np.array([0.7, -1.3, 2.1]), box, atype)
    assert out["energy"] == pytest.approx(ref["energy"], rel=1e-12)
    np.testing.assert_allclose(out["force"], ref["force"], atol=1e-10)
    perm = np.random.default_rng(4).permutation(len(atype))
    out = evaluate(model, coord[perm], box, atype[perm])
    assert out["energy"] == pytest.approx(ref["energy"], rel=1e-12)
    np.testing.assert_allclose(out["force"], ref["force"][perm], atol=1e-10)
    np.testing.assert_allclose(out["atom_energy"], ref["atom_energy"][perm], atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_frame_without_one_type(case):
    """Only oxygens (a composition of mixed-type data may lack a type): the per-centre-type
    paths meet an empty type; forces are still the energy's derivatives."""
    model = model_of(case)
    coord, box, atype = frame(True, seed=3)
    coord, atype = coord[atype == 0], atype[atype == 0]
    out = evaluate(model, coord, box, atype)
    assert np.isfinite(out["energy"]) and np.abs(out["force"]).max() > 1e-6
    plus, minus = coord.copy(), coord.copy()
    plus[0, 1] += H
    minus[0, 1] -= H
    fd = -(energy(model, plus, box, atype) - energy(model, minus, box, atype)) / (2 * H)
    assert out["force"][0, 1] == pytest.approx(fd, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_supercell_doubles_the_energy(case):
    model = model_of(case)
    coord, box, atype = frame(True, seed=5)
    ref = evaluate(model, coord, box, atype)
    big_coord = np.concatenate([coord, coord + box[0]])
    big_box = box * np.array([[2.0], [1.0], [1.0]])
    big_atype = np.concatenate([atype, atype])
    order = np.argsort(big_atype, kind="stable")
    out = evaluate(model, big_coord[order], big_box, big_atype[order])
    assert out["energy"] == pytest.approx(2 * ref["energy"], rel=1e-12)
    np.testing.assert_allclose(out["virial"], 2 * ref["virial"], atol=1e-9)
    force = np.concatenate([ref["force"], ref["force"]])[order]
    np.testing.assert_allclose(out["force"], force, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32_follows_float64(case):
    model = model_of(case)
    m32 = EnergyModel(
        battery_config(case[0], case[1], precision="float32")
        | {"fitting_net": {"neuron": [8, 8], "resnet_dt": True, "precision": "float32"}}
    )
    m32.load_state_dict(model.state_dict())
    m32.eval()
    assert m32.descriptor.embedding_nets()[0].layers[0].weight.dtype == torch.float32
    coord, box, atype = frame(True, seed=6)
    ref, out = evaluate(model, coord, box, atype), evaluate(m32, coord, box, atype)
    assert out["energy"].dtype == np.float64
    assert out["energy"] == pytest.approx(ref["energy"], rel=1e-5)
    assert rel_err(out["force"], ref["force"]) < 1e-4


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_excluded_pairs_do_not_interact(case):
    """O and H alone within rcut, their pair excluded: the energy does not depend on their
    distance and there are no forces."""
    model = model_of(case, exclude_types=[[0, 1]])
    atype = np.array([0, 1])
    energies = []
    for d in (1.0, 1.5, 2.5):
        out = evaluate(model, np.array([[0.0, 0.0, 0.0], [d, 0.3, 0.1]]), None, atype)
        np.testing.assert_allclose(out["force"], 0.0, atol=1e-14)
        energies.append(float(out["energy"]))
    assert energies == pytest.approx([energies[0]] * 3, rel=1e-14)
    free = model_of(case)
    far = evaluate(free, np.array([[0.0, 0.0, 0.0], [1.0, 0.3, 0.1]]), None, atype)
    assert np.abs(far["force"]).max() > 1e-4


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("exclude", [[], [[0, 1]]], ids=["all", "excluded"])
def test_statistics_from_pairs_equal_those_of_the_padded_lists(case, exclude):
    systems = [make_system(3, True, 3, 1), make_system(2, False, 2, 2), make_system(1, True, 2, 4)]
    cfg = battery_config(case[0], case[1], exclude_types=exclude)
    model = EnergyModel(cfg)
    expected = descriptor_stat_items(collect_stat_batches(systems, cfg, 2), model)
    got = stream_stat_inputs(systems, model, stat_batch_plan(systems, 2), show_progress=False)[0]
    assert got.keys() == expected.keys()
    assert set(got) == {f"{g}_{t}" for g in model.descriptor.stat_groups for t in range(2)}
    for key, item in expected.items():
        assert got[key].number == item.number, key
        assert got[key].sum == pytest.approx(item.sum, rel=1e-12, abs=1e-13), key
        assert got[key].squared_sum == pytest.approx(item.squared_sum, rel=1e-12), key
    davg, dstd = model.descriptor.stats_from_items(got)
    assert davg.shape == dstd.shape == tuple(model.descriptor.davg.shape)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_checkpoint_state_rebuilds_the_same_model_and_scripts(case):
    model = model_of(case)
    again = EnergyModel(model.get_model_config())
    again.load_state_dict(model.state_dict())
    coord, box, atype = frame(True, seed=7)
    ref = evaluate(model, coord, box, atype)
    out = evaluate(again.eval(), coord, box, atype)
    for key in ("energy", "force", "virial"):
        np.testing.assert_array_equal(out[key], ref[key])  # bit for bit
    out = evaluate(torch.jit.script(again), coord, box, atype)
    for key in ("energy", "force", "virial"):
        np.testing.assert_allclose(out[key], ref[key], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", NAMED, ids=NAMED_IDS)
def test_calculator_freeze_and_test_commands(case, tmp_path):
    """Freezing to .pth, the calculator and ``mdtrain test`` on it; torch 2.13 deprecates
    TorchScript, and none of them says so (the module's filter of that notice set aside)."""
    from ase import Atoms

    from mdtrain.cli import main
    from mdtrain.infer.calculator import MDTrainCalculator
    from mdtrain.infer.load import load_model
    from mdtrain.train.checkpoint import save_checkpoint
    from tests.helpers.datagen import water_labeled, write_npy_system

    model = model_of(case)
    ckpt = tmp_path / "model.ckpt.pt"
    save_checkpoint(
        ckpt, {"model_config": model.get_model_config(), "model_state": model.state_dict()}
    )
    frozen = tmp_path / "frozen.pth"
    coord, box, atype = frame(True, seed=8)
    ref = evaluate(model, coord, box, atype)
    symbols = ["O" if t == 0 else "H" for t in atype]
    system = tmp_path / "sys"
    write_npy_system(system, **water_labeled(2, 3, seed=3))
    figures = tmp_path / "test.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["freeze", str(ckpt), "-o", str(frozen)]) == 0
        for path in (str(ckpt), str(frozen)):
            atoms = Atoms(symbols, positions=coord, cell=box, pbc=True)
            atoms.calc = MDTrainCalculator(path)
            assert atoms.get_potential_energy() == pytest.approx(float(ref["energy"]), abs=1e-10)
            np.testing.assert_allclose(atoms.get_forces(), ref["force"], atol=1e-10)
        assert main(["test", "-m", str(frozen), "-s", str(system), "--json", str(figures)]) == 0
        load_model(frozen, scripted=True)
    assert "energy" in figures.read_text()
    notices = [str(w.message) for w in caught if "deprecated" in str(w.message).lower()]
    notices = [m for m in notices if "jit" in m or "TorchScript" in m]
    assert not notices, notices[0]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_deepmd_model_file_round_trip(case, tmp_path):
    """``.dp`` export then import gives the same parameters and outputs bit for bit; what
    has no .dp form is refused in one line naming the key."""
    from mdtrain.model.deepmd_file import load_dp, write_dp
    from mdtrain.model.deepmd_format import model_to_deepmd

    model = model_of(case)
    path = tmp_path / "model.dp"
    if case[0] in ("se_e2_r", "hybrid") and case[1] == {"type_one_side": False}:
        where = "model/descriptor/list\\[1\\]" if case[0] == "hybrid" else "model/descriptor"
        with pytest.raises(MDTrainError, match=f"{where}/type_one_side"):
            write_dp(model, path)
        return
    write_dp(model, path)
    fitting = model_to_deepmd(model)["fitting"]  # one net for all types, or one per type
    assert fitting["mixed_types"] is model.fitting.mixed_types
    assert fitting["nets"]["ndim"] == (0 if model.fitting.mixed_types else 1)
    assert len(fitting["nets"]["networks"]) == len(model.fitting.networks)
    state = load_dp(path)
    back = EnergyModel(state["model_config"])
    back.load_state_dict(state["model_state"])
    # a file has no seed; "default" is read as float64 (the type-embedding descriptors' files
    # keep the word "default")
    got = back.get_model_config()["descriptor"]
    desc = model.get_model_config()["descriptor"]
    same = {"seed": None, "precision": got.get("precision", "float64")}
    assert same["precision"] in ("default", "float64")
    if "list" in desc:  # each member as the rule of its kind says
        for m, back_m in zip(desc["list"], got["list"], strict=True):
            assert back_m.get("precision") in ("default", "float64")
            m |= {"seed": None, "precision": back_m.get("precision")}
    else:
        desc |= same
    assert got == desc
    coord, box, atype = frame(True, seed=9)
    ref, out = evaluate(model, coord, box, atype), evaluate(back.eval(), coord, box, atype)
    for key in ("energy", "force", "virial"):
        np.testing.assert_array_equal(out[key], ref[key])


@pytest.mark.parametrize("case", NAMED, ids=NAMED_IDS)
def test_training_restarts_exactly(case, tmp_path):
    """A short training run with the statistics and stat file, then the same run resumed from
    its middle checkpoint: the same parameters and learning curve, bit for bit."""
    import json
    import os

    from mdtrain.cli import main
    from tests.helpers.training import lcurve_rows, load_params, make_project

    inp = make_project(tmp_path, stat_file="stat.hdf5")
    config = json.loads(inp.read_text())
    config["model"]["descriptor"] = battery_config(*case, sel="auto")["descriptor"]
    inp.write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["train", str(inp), "-o", str(out)]) == 0
    full = load_params(out / "model.ckpt-6.pt")
    rows = lcurve_rows(out / "lcurve.out")
    assert np.isfinite(rows[:, 1:]).all()
    os.remove(out / "model.ckpt-6.pt")
    assert main(["train", str(inp), "-o", str(out), "--restart", str(out / "model.ckpt-3.pt")]) == 0
    again = load_params(out / "model.ckpt-6.pt")
    assert full.keys() == again.keys()
    for key in full:
        assert torch.equal(full[key], again[key]), key
    np.testing.assert_array_equal(lcurve_rows(out / "lcurve.out"), rows)
