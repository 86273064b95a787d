"""DeePMD-kit's ``.dp`` model file: what mdtrain writes has DeePMD-kit 3.x's layout, reads back
to the same model (weights bit for bit, outputs identical) for every se_e2_a setting mdtrain
trains, and what mdtrain cannot run is refused in one line naming the file and the key.
(DeePMD-kit's own numbers: tests/infer/test_deepmd_fixture.py and the interop tier.)"""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from mdtrain.model.deepmd_file import is_dp_file, load_dp, read_dp, write_dp
from mdtrain.model.energy import EnergyModel
from tests.helpers.models import make_model, triclinic, water_like

CONFIGS = {
    "two_side": ({"type_one_side": False}, {}, {}),
    "one_side": ({"type_one_side": True}, {}, {}),
    "resnet_dt": ({"resnet_dt": True, "neuron": [5, 10, 20]}, {"neuron": [12, 24]}, {}),
    "exclusions": (
        {"type_one_side": False, "exclude_types": [[0, 1]]},
        {},
        {"atom_exclude_types": [1]},
    ),
    "one_side_exclusions": ({"type_one_side": True, "exclude_types": [[1, 1]]}, {}, {}),
    "protection_davg_zero": ({"env_protection": 0.2, "set_davg_zero": True}, {}, {}),
    "float32_nets": ({"precision": "float32"}, {"precision": "float32"}, {}),
    "mixed_precision": ({"precision": "float32"}, {"precision": "float64"}, {}),
    "activations": ({"activation_function": "gelu"}, {"activation_function": "silu"}, {}),
    "frozen_fitting": ({"trainable": False}, {"trainable": False, "resnet_dt": False}, {}),
}


def frames() -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
    box = triclinic(5.0, seed=3)
    periodic, atype = water_like(3, box, seed=4)
    cluster, atype2 = water_like(3, None, seed=5)
    return [(periodic, box, atype), (cluster, None, atype2)]


def outputs(model: torch.nn.Module) -> list[dict[str, np.ndarray]]:
    from tests.helpers.models import evaluate

    return [evaluate(model, c, b, a) for c, b, a in frames()]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_is_exact(tmp_path, name):
    desc, fit, model_kw = CONFIGS[name]
    model = make_model(desc, fit, **model_kw)
    path = tmp_path / "model.dp"
    write_dp(model, path, min_nbor_dist=0.87)
    assert is_dp_file(path)
    state = load_dp(path)
    assert state["min_nbor_dist"] == 0.87
    back = EnergyModel(state["model_config"])
    back.load_state_dict(state["model_state"])
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype, key
        # davg/dstd are stored in the descriptor's precision, as DeePMD-kit does (and used so)
        dtype = model.descriptor.dtype if key.startswith("descriptor.d") else ours[key].dtype
        assert torch.equal(ours[key].to(dtype), theirs[key].to(dtype)), key
    cfg, cfg_back = model.get_model_config(), back.get_model_config()
    for section in ("descriptor", "fitting_net"):
        for key in ("sel", "rcut", "neuron", "type_one_side", "resnet_dt", "exclude_types"):
            if key in cfg[section]:
                assert cfg_back[section][key] == cfg[section][key], (section, key)
    assert cfg_back["atom_exclude_types"] == cfg["atom_exclude_types"]
    for a, b in zip(outputs(model), outputs(back), strict=True):
        for key in ("energy", "force", "virial"):
            np.testing.assert_array_equal(b[key], a[key])
    loaded = load_model(path)  # the path every command takes: the fastest backend
    tol = 1e-12 if model.descriptor.dtype == torch.float64 else 1e-5
    for a, b in zip(outputs(model), outputs(loaded), strict=True):
        for key in ("energy", "force", "virial"):
            np.testing.assert_allclose(b[key], a[key], rtol=tol, atol=tol)


def test_layout_is_deepmd_kits(tmp_path):
    """Root attribute ``json`` with the header and the model; arrays as root datasets named
    in the JSON; DeePMD-kit's classes, versions and net indexing (centre + neighbour·ntypes)."""
    model = make_model({"resnet_dt": True, "type_one_side": False}, {}, atom_exclude_types=[1])
    path = tmp_path / "model.dp"
    write_dp(model, path, min_nbor_dist=1.0)
    with h5py.File(path, "r") as f:
        data = json.loads(f.attrs["json"])
        names = set(f.keys())
        assert all(name.startswith("variable_") for name in names)
        davg_name = data["model"]["descriptor"]["@variables"]["davg"]
        assert davg_name.lstrip("/") in names
        assert f[davg_name].shape == (2, sum(model.sel), 4)
    for key in ("software", "version", "time", "model", "model_def_script"):
        assert key in data
    m = data["model"]
    assert (m["@class"], m["type"], m["@version"]) == ("Model", "standard", 2)
    d, fit = m["descriptor"], m["fitting"]
    assert (d["@class"], d["type"], d["@version"]) == ("Descriptor", "se_e2_a", 2)
    assert (fit["@class"], fit["type"], fit["@version"]) == ("Fitting", "ener", 4)
    assert d["embeddings"]["ndim"] == 2 and len(d["embeddings"]["networks"]) == 4
    assert fit["exclude_types"] == [1] and m["atom_exclude_types"] == [1]
    first, second = d["embeddings"]["networks"][0]["layers"][:2]  # 1 -> 4 -> 8
    assert (first["@class"], first["@version"]) == ("Layer", 2)
    assert (first["use_timestep"], second["use_timestep"]) == (False, True)  # idt with a skip
    assert fit["nets"]["networks"][0]["layers"][-1]["activation_function"] == "none"
    raw = read_dp(path)
    # net 1 = centre type 1 (H), neighbour type 0 (O): our flat index centre + neighbour·ntypes
    w = raw["model"]["descriptor"]["embeddings"]["networks"][1]["layers"][0]["@variables"]["w"]
    assert np.array_equal(w, model.descriptor.networks[1].layers[0].weight.detach().numpy())
    # the bias as the fitting's bias_atom_e (what DeePMD-kit's compression keeps), out_bias 0
    out_bias = raw["model"]["@variables"]["out_bias"]
    assert out_bias.shape == (1, 2, 1) and not out_bias.any()
    bias_atom_e = raw["model"]["fitting"]["@variables"]["bias_atom_e"]
    assert np.array_equal(bias_atom_e, model.out_bias.numpy().reshape(2, 1))
    assert raw["@variables"]["min_nbor_dist"] == 1.0 and raw["min_nbor_dist"] == 1.0


def test_bias_atom_e_adds_to_out_bias(tmp_path):
    """A file with both biases (DeePMD-kit's PyTorch models use out_bias, its TensorFlow ones
    bias_atom_e) gives their sum."""
    model = make_model()
    path = tmp_path / "model.dp"
    write_dp(model, path)
    with h5py.File(path, "r+") as f:
        data = json.loads(f.attrs["json"])
        name = data["model"]["@variables"]["out_bias"]
        f[name][...] = np.array([0.5, -0.25]).reshape(1, 2, 1)
    state = load_dp(path)
    expected = model.out_bias.numpy() + np.array([0.5, -0.25])
    assert np.allclose(state["model_state"]["out_bias"].numpy(), expected, rtol=0, atol=1e-15)


def _edit_json(path, edit) -> None:
    with h5py.File(path, "r+") as f:
        data = json.loads(f.attrs["json"])
        edit(data)
        f.attrs["json"] = json.dumps(data)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (
            lambda d: d["model"]["descriptor"].update(type="dpa2"),
            "model/descriptor/type: descriptor 'dpa2'",
        ),
        (
            lambda d: d["model"]["fitting"].update(dim_case_embd=2),
            "model/fitting/dim_case_embd: a case embedding",
        ),
        (
            lambda d: d["model"]["fitting"].update(type="population"),
            "model/fitting/type: fitting 'population'",
        ),
        (lambda d: d["model"].update(type="zbl"), "a 'zbl' model is not supported"),
        (
            lambda d: d["model"]["descriptor"].update(spin={"use_spin": [True]}),
            "model/descriptor/spin",
        ),
        (lambda d: d["model"].update(pair_exclude_types=[[0, 1]]), "model/pair_exclude_types"),
        (lambda d: d["model"]["fitting"].update(mixed_types=True), "model/fitting/mixed_types"),
        (
            lambda d: d["model"]["descriptor"]["env_mat"].update(use_exp_switch=True),
            "use_exp_switch",
        ),
        (
            lambda d: d["model"]["descriptor"].update(activation_function="silut"),
            "activation 'silut'",
        ),
        (lambda d: d.pop("model"), "file: missing 'model'"),
    ],
)
def test_unsupported_content_is_one_line(tmp_path, edit, words):
    path = tmp_path / "model.dp"
    write_dp(make_model(), path)
    _edit_json(path, edit)
    with pytest.raises(MDTrainError) as info:
        load_dp(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and words in message, message


def test_not_a_model_file(tmp_path):
    path = tmp_path / "other.dp"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(MDTrainError, match="without a 'json' attribute"):
        load_model(path)
    truncated = tmp_path / "cut.dp"
    write_dp(make_model(), truncated)
    truncated.write_bytes(truncated.read_bytes()[:4000])
    with pytest.raises(MDTrainError, match="cannot read the DeePMD-kit model file"):
        load_model(truncated)


def test_gelu_erf_has_no_deepmd_equivalent(tmp_path):
    model = make_model({"activation_function": "gelu_erf"})
    with pytest.raises(MDTrainError, match="no DeePMD-kit equivalent"):
        write_dp(model, tmp_path / "model.dp")
    assert not (tmp_path / "model.dp").exists()


def test_tensorflow_graph_gets_the_conversion_hint(tmp_path):
    path = tmp_path / "frozen_model.pb"
    path.write_bytes(b"\x0a\x10not really a graph")
    with pytest.raises(MDTrainError, match="dp convert-backend .*frozen_model.pb model.dp"):
        load_model(path)
