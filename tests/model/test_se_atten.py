"""se_atten (DPA-1), se_atten_v2 and se_e3_tebd against DeePMD-kit 3.2's own numpy implementation (the
committed fixture ``tests/fixtures/deepmd/se_atten.npz``), its serialised form both ways, its
statistics, and the properties an energy built on it must have (forces = −dE/dR by finite
differences, rotation and permutation invariance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.deepmd_nets import Reader
from mdtrain.model.descriptors.mixed_stats import mixed_env_stat_items, mixed_env_stat_sums
from mdtrain.model.descriptors.se_atten import (
    DEFAULTS,
    DescriptorSeAtten,
    DescriptorSeAttenV2,
)
from mdtrain.model.descriptors.se_e3_tebd import DescriptorSeE3Tebd
from mdtrain.neighbors.nlist import neighbor_pairs
from tests.helpers import deepmd_descriptors as fixture
from tests.helpers.placement import OTHER, OtherDevice

VARIANTS = fixture.variants()
CLASSES = {
    "dpa1": DescriptorSeAtten,
    "se_atten_v2": DescriptorSeAttenV2,
    "se_e3_tebd": DescriptorSeE3Tebd,
}


def from_deepmd(data: dict):
    return CLASSES[data["type"]].from_deepmd_dict(data)


def evaluate(desc, group: str, coord=None, box=None, requires_grad: bool = False):
    """D of a fixture frame group (or of ``coord``/``box`` with that group's types), lists
    built by mdtrain's type-mixed neighbour list."""
    frames = fixture.frames(group)
    coord = frames["coord"] if coord is None else coord
    box = frames["box"] if box is None else box
    nlist, shift = fixture.mixed_inputs(coord, box, desc.rcut, desc.nnei)
    coord_t = torch.tensor(coord, requires_grad=requires_grad)
    box_t = None if box is None else torch.as_tensor(box)
    diff = fixture.pair_diff(coord_t, box_t, nlist, shift)
    return desc(diff, nlist, torch.as_tensor(frames["atype"])), coord_t


def rel_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.mark.parametrize("group", fixture.GROUPS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_descriptor_matches_deepmd(variant: str, group: str) -> None:
    desc = from_deepmd(fixture.serialized(variant))
    assert type(desc) is CLASSES[fixture.serialized(variant)["type"]]
    d, _ = evaluate(desc, group)
    want = fixture.expected(variant, group)
    assert d.shape == want.shape == (*fixture.frames(group)["coord"].shape[:2], desc.dim_out)
    assert rel_err(d.detach().numpy(), want) < 1e-10


def _canonical(obj, values: bool = True):
    """Serialised dicts compared by meaning: DeePMD-kit spells the identity "Linear" or
    "none"; arrays by value (or by dtype and shape only)."""
    if isinstance(obj, dict):
        return {k: _canonical(v, values) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v, values) for v in obj]
    if isinstance(obj, np.ndarray):
        return ("array", obj.dtype.name, obj.shape, obj.tobytes() if values else None)
    if isinstance(obj, str) and obj.lower() in ("linear", "none"):
        return "identity"
    return obj


@pytest.mark.parametrize("variant", VARIANTS)
def test_serialised_form_round_trip(variant: str) -> None:
    """to_deepmd(from_deepmd(x)) is DeePMD-kit's own dict x, key for key, bit for bit."""
    original = fixture.serialized(variant)
    assert _canonical(from_deepmd(original).to_deepmd()) == _canonical(original)


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_builds_deepmd_layout(variant: str) -> None:
    """The argcheck-filled section builds a descriptor of DeePMD-kit's shapes and settings."""
    config = fixture.config(variant)
    cls = DescriptorSeE3Tebd if config["type"] == "se_e3_tebd" else DescriptorSeAtten
    built = cls.from_config({**config, "seed": 1}, ntypes=3, type_map=["O", "H", "C"])
    loaded = from_deepmd(fixture.serialized(variant))
    shapes = {k: tuple(v.shape) for k, v in built.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in loaded.state_dict().items()}
    assert _canonical(built.to_deepmd(), values=False) == _canonical(
        loaded.to_deepmd(), values=False
    )
    assert type(built) is type(loaded) and built.dim_out == loaded.dim_out
    again = cls.from_config({**config, "seed": 1}, ntypes=3, type_map=["O", "H", "C"])
    assert all(torch.equal(a, b) for a, b in zip(built.parameters(), again.parameters()))


@pytest.mark.parametrize("variant", VARIANTS)
def test_section_of_a_loaded_descriptor(variant: str) -> None:
    """A descriptor read from DeePMD-kit's dict gives back the section argcheck filled for it
    (``ln_eps`` 1e-5 is written unset, its default), and that section builds the same
    layout."""
    loaded = from_deepmd(fixture.serialized(variant))
    section = loaded.to_config()
    want = {**fixture.config(variant)}
    want.update({k: None for k in set(section) - set(want)})  # unset keys without default
    if want.get("ln_eps") == 1e-5:
        want["ln_eps"] = None
    want["type"] = {"dpa1": "se_atten"}.get(want["type"], want["type"])
    assert section == want
    rebuilt = type(loaded).from_config(section, ntypes=3)
    assert rebuilt.to_config() == section


@pytest.mark.parametrize("variant", ["default", "smooth", "layer0_one_side_excl", "v2", "e3_tebd"])
def test_statistics_match_deepmd(variant: str) -> None:
    """davg/dstd from mdtrain's type-mixed lists equal DeePMD-kit's compute_input_stats on the
    same frames (both groups; exclusions and padding counted as DeePMD-kit does)."""
    data = fixture.serialized(variant)
    desc = from_deepmd(data)
    frames = []
    for group in fixture.GROUPS:
        g = fixture.frames(group)
        for k in range(len(g["coord"])):
            frames.append((g["coord"][k], None if g["box"] is None else g["box"][k], g["atype"]))
    items = mixed_env_stat_items(desc, frames)
    davg, dstd = desc.stats_from_items(items)
    assert rel_err(dstd, data["@variables"]["dstd"]) < 1e-12
    assert rel_err(davg, data["@variables"]["davg"]) < 1e-12 or not davg.any()
    assert np.array_equal(davg == 0, data["@variables"]["davg"] == 0)


@pytest.mark.parametrize("variant", ["smooth", "layer0_one_side_excl", "e3_tebd"])
def test_pair_terms_sum_to_the_list_sums(variant: str) -> None:
    """Streaming the statistics pair by pair (``pair_stat_terms``, what the statistics code
    sums without building lists) equals the sums over the padded lists when no list is
    truncated: the cluster, whose atoms have fewer neighbours than sel."""
    desc = from_deepmd(fixture.serialized(variant))
    g = fixture.frames("cluster")
    atype = torch.as_tensor(g["atype"])
    nlist, shift = fixture.mixed_inputs(g["coord"], None, desc.rcut, desc.nnei)
    diff = fixture.pair_diff(torch.as_tensor(g["coord"]), None, nlist, shift)
    want = mixed_env_stat_sums(desc, diff, nlist, atype)
    pairs = neighbor_pairs(g["coord"][0], None, desc.rcut)
    i, j = torch.as_tensor(pairs.i), torch.as_tensor(pairs.j)
    coord = torch.as_tensor(g["coord"][0])
    terms = desc.pair_stat_terms(coord[j] - coord[i])
    keep = desc.pair_keep[atype[i], atype[j]].to(torch.float64)
    sums = torch.stack(
        [torch.zeros(3, dtype=torch.float64).index_add(0, atype[i], t * keep) for t in terms], 1
    )
    assert torch.allclose(sums[:, [0, 1]], want[:, 0, 1:], rtol=1e-12, atol=0)
    assert torch.allclose(sums[:, [2, 3]], want[:, 1, 1:], rtol=1e-12, atol=0)


@pytest.mark.parametrize("group", fixture.GROUPS)
@pytest.mark.parametrize(
    "variant", ["default", "strip", "strip_one_side_smooth", "lmax3", "v2", "e3_tebd_strip"]
)
def test_forces_finite_differences(variant: str, group: str) -> None:
    """dE/dR of E = Σ c·D (fixed random c) by autograd equals central differences, with the
    lists held fixed; the cluster has a centre without neighbours (gradients stay finite)."""
    desc = from_deepmd(fixture.serialized(variant))
    frames = fixture.frames(group)
    nlist, shift = fixture.mixed_inputs(frames["coord"], frames["box"], desc.rcut, desc.nnei)
    box = None if frames["box"] is None else torch.as_tensor(frames["box"])
    atype = torch.as_tensor(frames["atype"])
    weights = torch.as_tensor(np.random.default_rng(5).normal(size=(desc.dim_out,)))

    def energy(coord: torch.Tensor) -> torch.Tensor:
        return (desc(fixture.pair_diff(coord, box, nlist, shift), nlist, atype) * weights).sum()

    coord = torch.tensor(frames["coord"], requires_grad=True)
    (grad,) = torch.autograd.grad(energy(coord), coord)
    assert torch.isfinite(grad).all()
    h = 1e-5
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for f, i, c in zip(
            rng.integers(0, coord.shape[0], 6),
            rng.integers(0, coord.shape[1], 6),
            rng.integers(0, 3, 6),
        ):
            plus, minus = coord.detach().clone(), coord.detach().clone()
            plus[f, i, c] += h
            minus[f, i, c] -= h
            numeric = (energy(plus) - energy(minus)) / (2 * h)
            assert abs(float(numeric) - float(grad[f, i, c])) < 1e-7 * max(1.0, abs(float(numeric)))


def _rotation(seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    return q * np.sign(np.linalg.det(q))


@pytest.mark.parametrize("variant", ["default", "smooth", "strip", "lmax3", "v2", "e3_tebd"])
def test_rotation_and_translation_invariance(variant: str) -> None:
    desc = from_deepmd(fixture.serialized(variant))
    frames = fixture.frames("periodic")
    rot = _rotation(3)
    d0, _ = evaluate(desc, "periodic")
    d1, _ = evaluate(desc, "periodic", frames["coord"] @ rot.T + 0.7, frames["box"] @ rot.T)
    assert rel_err(d1.detach().numpy(), d0.detach().numpy()) < 1e-12


@pytest.mark.parametrize(
    "variant", ["default", "smooth", "strip", "temperature", "v2", "e3_tebd_strip"]
)
def test_permutation_invariance(variant: str) -> None:
    """Atoms permuted (keeping atom 0: DeePMD-kit gives empty slots atom 0's type, which
    enters D when davg ≠ 0) and slots shuffled: D follows the atoms."""
    desc = from_deepmd(fixture.serialized(variant))
    frames = fixture.frames("cluster")
    coord, atype = frames["coord"], frames["atype"]
    perm = np.concatenate([[0], 1 + np.random.default_rng(2).permutation(len(atype) - 1)])
    nlist, shift = fixture.mixed_inputs(coord, None, desc.rcut, desc.nnei)
    diff = fixture.pair_diff(torch.as_tensor(coord), None, nlist, shift)
    d0 = desc(diff, nlist, torch.as_tensor(atype))
    inverse = np.argsort(perm)
    nlist_p = torch.where(nlist >= 0, torch.as_tensor(inverse)[nlist.clamp(min=0)], -1)[:, perm]
    slots = torch.as_tensor(np.random.default_rng(4).permutation(desc.nnei))
    d1 = desc(diff[:, perm][:, :, slots], nlist_p[:, :, slots], torch.as_tensor(atype[perm]))
    assert rel_err(d1.detach().numpy(), d0[:, perm].detach().numpy()) < 1e-12


def test_defaults_and_fixed_keys() -> None:
    desc = DescriptorSeAtten(2, 20)
    assert desc.sel == [20] and desc.mixed_types and desc.set_davg_zero
    assert desc.dim_out == 40 * 4 + 8 and not desc.strip and not desc.smooth
    assert len(desc.attention) == DEFAULTS["attn_layer"] == 2
    v2 = DescriptorSeAttenV2(2, [8, 12])
    assert v2.sel == [20] and v2.strip and v2.smooth and not v2.set_davg_zero
    assert DescriptorSeAtten(2, 20, stripped_type_embedding=True).strip


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DescriptorSeAtten(2, 20, attn_mask=True), "attn_mask"),
        (lambda: DescriptorSeAtten(2, 0), "sel"),
        (lambda: DescriptorSeAtten(2, 20, rcut=3.0, rcut_smth=3.0), "rcut_smth"),
        (lambda: DescriptorSeE3Tebd(2, 20, exclude_types=[[0, 2]]), "exclude_types"),
        (lambda: DescriptorSeAtten(2, 20, neuron=[4, 8], axis_neuron=9), "axis_neuron"),
        (lambda: DescriptorSeAtten(2, 20, tebd_input_mode="sum"), "tebd_input_mode"),
        (lambda: DescriptorSeAtten(2, 20, lmax=5), "lmax"),
        (lambda: DescriptorSeAtten(2, 20, use_econf_tebd=True), "use_econf_tebd"),
        (lambda: DescriptorSeAtten(2, 20, activation_function="silut"), "activation_function"),
        (lambda: DescriptorSeAttenV2(2, 20, tebd_input_mode="concat"), "tebd_input_mode"),
        (lambda: DescriptorSeAtten.from_config({"type": "se_atten", "sel": 4, "atn": 3}, 2), "atn"),
        (lambda: DescriptorSeE3Tebd.check_config({"type": "se_e3_tebd", "sel": 4, "tebd_input_mode": "sum"}, 2), "tebd_input_mode"),
        (lambda: DescriptorSeAtten.from_config({"type": "se_atten_v2", "sel": 4, "smooth_type_embedding": False}, 2), "smooth_type_embedding"),
    ],
)  # fmt: skip
def test_refused_settings_name_the_key(build, message: str) -> None:
    with pytest.raises(MDTrainError, match=message):
        build()


def test_refused_deepmd_files_name_the_key() -> None:
    data = fixture.serialized("smooth")
    for key, value in (("compress", {"x": 1}), ("use_econf_tebd", True), ("type", "dpa2")):
        with pytest.raises(MDTrainError, match=key if key != "type" else "dpa2"):
            DescriptorSeAtten.from_deepmd_dict({**data, key: value})
    with pytest.raises(MDTrainError, match="dpa1"):
        DescriptorSeE3Tebd.from_deepmd_dict(data)
    broken = {**data, "@variables": {**data["@variables"], "davg": np.zeros((3, 2, 4))}}
    with pytest.raises(MDTrainError, match="davg"):
        from_deepmd(broken)


@pytest.mark.parametrize("variant", ["default", "strip_one_side_smooth", "lmax3", "e3_tebd_strip"])
def test_torchscript_gives_the_same_descriptor(variant: str) -> None:
    """Freezing scripts the model: the scripted descriptor equals the eager one bit for bit."""
    desc = from_deepmd(fixture.serialized(variant))
    scripted = torch.jit.script(desc)
    for group in fixture.GROUPS:
        frames = fixture.frames(group)
        nlist, shift = fixture.mixed_inputs(frames["coord"], frames["box"], desc.rcut, desc.nnei)
        box = None if frames["box"] is None else torch.as_tensor(frames["box"])
        diff = fixture.pair_diff(torch.as_tensor(frames["coord"]), box, nlist, shift)
        atype = torch.as_tensor(frames["atype"])
        assert torch.equal(scripted(diff, nlist, atype), desc(diff, nlist, atype))


@pytest.mark.parametrize("variant", ["smooth", "layer0_one_side_excl", "lmax3", "v2", "e3_tebd"])
def test_float32_follows_float64(variant: str) -> None:
    """A float32 descriptor (DeePMD-kit's ``precision``) computes in float32, near float64.

    Not asserted without ``smooth_type_embedding``: there a neighbour just inside the cut-off
    keeps its full attention weight while its row ``w(r)·d/r²`` is float32 rounding (the
    switch polynomial cancels), so its direction, and D, can flip (1e-2 on the fixture's
    frame; DeePMD-kit's float32 does the same)."""
    data = fixture.serialized(variant)
    double = from_deepmd(data)
    single = from_deepmd(
        {**data, "type_embedding": {**data["type_embedding"], "precision": "float32"}}
    )
    assert all(p.dtype == torch.float32 for p in single.parameters())
    d64, _ = evaluate(double, "periodic")
    d32, _ = evaluate(single, "periodic")
    assert d32.dtype == torch.float32
    assert rel_err(d32.detach().double().numpy(), d64.detach().numpy()) < 1e-5


@pytest.mark.parametrize("variant", ["default", "strip", "lmax3", "e3_tebd_strip"])
def test_placement_on_another_device(variant: str) -> None:
    """Every tensor the descriptor makes lies on its device (tests/helpers/placement.py)."""
    desc = from_deepmd(fixture.serialized(variant))
    frames = fixture.frames("cluster")
    nlist, shift = fixture.mixed_inputs(frames["coord"], None, desc.rcut, desc.nnei)
    diff = fixture.pair_diff(torch.as_tensor(frames["coord"]), None, nlist, shift)
    atype = torch.as_tensor(frames["atype"])
    want = desc(diff, nlist, atype)
    with OtherDevice() as other:
        moved = desc.to(OTHER)
        got = moved(diff.to(OTHER), nlist.to(OTHER), atype.to(OTHER))
        assert got.device == OTHER and other.cpu_factories == []
        got = got.to("cpu")
    assert torch.equal(torch.as_tensor(got), want)


@pytest.mark.parametrize("variant", ["strip_one_side_smooth", "lmax3", "v2", "e3_tebd_strip"])
def test_registry_form_of_the_deepmd_dict(variant: str) -> None:
    """``from_deepmd(reader, dict, state)`` (the registry's form, for ``.dp`` import) gives the
    section and the ``descriptor.*`` state that build the same descriptor; ``to_deepmd(cfg,
    type_map)`` gives DeePMD-kit's dict with that type_map; refusals name the file."""
    data = fixture.serialized(variant)
    cls = CLASSES[data["type"]]
    state: dict = {}
    section = cls.from_deepmd(Reader("model.dp"), data, state)
    built = type(from_deepmd(data)).from_config(section, ntypes=3)
    built.load_state_dict({k.removeprefix("descriptor."): v for k, v in state.items()})
    d0, _ = evaluate(built, "cluster")
    assert rel_err(d0.detach().numpy(), fixture.expected(variant, "cluster")) < 1e-10
    out = built.to_deepmd(section, ["A", "B", "C"])
    assert out["type_map"] == out["type_embedding"]["type_map"] == ["A", "B", "C"]
    with pytest.raises(MDTrainError, match="^model.dp: .*use_econf_tebd"):
        cls.from_deepmd(Reader("model.dp"), {**data, "use_econf_tebd": True}, {})


def test_switch_rounds_as_deepmd_near_the_cut_off() -> None:
    """Within 1e-4 Å of rcut the switch is ~1e-15 of cancellation, and non-smooth se_atten's
    attention direction is proportional to it: the type-mixed descriptors compute it in
    DeePMD-kit's order of operations (a transcription of compute_smooth_weight), bit for bit."""
    from mdtrain.model.descriptors.mixed_base import switch

    def deepmd_order(distance, rmin, rmax):
        uu = (torch.clamp(distance, min=rmin, max=rmax) - rmin) / (rmax - rmin)
        uu2 = uu * uu
        return uu2 * uu * (-6 * uu2 + 15 * uu - 10) + 1

    gen = torch.Generator().manual_seed(2)
    r = torch.cat([0.5 + 5.5 * torch.rand(5000, generator=gen, dtype=torch.float64),
                   6.0 - 1e-4 * torch.rand(5000, generator=gen, dtype=torch.float64)])  # fmt: skip
    ours = switch(r, 0.5, 6.0)
    assert torch.equal(ours, deepmd_order(r, 0.5, 6.0))
    assert (ours[5000:] != 10 * ((6.0 - r[5000:]) / 5.5) ** 3).any()  # rounding is at stake
