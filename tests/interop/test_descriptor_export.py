"""The type-embedding descriptors (se_atten, se_atten_v2, se_e3_tebd) as DeePMD-kit reads them:
mdtrain's ``to_deepmd()`` of freshly built, seeded descriptors with non-trivial statistics,
deserialised and evaluated by DeePMD-kit's own numpy implementation
(``deepmd_descriptor_driver.py``), give mdtrain's descriptor to 1e-10 (float32: 1e-5);
DeePMD-kit's re-serialisation equals ours; and our defaults are its argcheck's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mdtrain.model.descriptors.se_atten import DEFAULTS, V2_DEFAULTS, DescriptorSeAtten
from mdtrain.model.descriptors.se_e3_tebd import DEFAULTS as E3_DEFAULTS
from mdtrain.model.descriptors.se_e3_tebd import DescriptorSeE3Tebd
from tests.helpers import deepmd_descriptors as fixture
from tests.helpers.deepmd import rel_diff
from tests.helpers.serialized_npz import entries, read

pytestmark = pytest.mark.interop

DRIVER = fixture.FIXTURE.parents[2] / "interop" / "deepmd_descriptor_driver.py"
SMALL = {"sel": 14, "rcut": 3.3, "rcut_smth": 0.6, "neuron": [4, 8], "tebd_dim": 3}
CASES = {
    "atten_smooth": {"type": "se_atten", **SMALL, "axis_neuron": 2, "attn": 6,
                     "set_davg_zero": False, "smooth_type_embedding": True, "resnet_dt": True},
    "atten_strip_f32": {"type": "se_atten", **SMALL, "axis_neuron": 3, "attn": 5,
                        "precision": "float32", "tebd_input_mode": "strip",
                        "exclude_types": [[0, 1]], "set_davg_zero": False},
    "atten_lmax2": {"type": "se_atten", **SMALL, "axis_neuron": 2, "attn": 4, "lmax": 2,
                    "attn_layer": 1, "type_one_side": True, "temperature": 0.3,
                    "normalize": False, "use_tebd_bias": True, "env_protection": 0.1},
    "v2": {"type": "se_atten_v2", **SMALL, "axis_neuron": 2, "attn": 6, "attn_dotr": False,
           "concat_output_tebd": False, "activation_function": "silu"},
    "e3_tebd": {"type": "se_e3_tebd", **SMALL, "sel": 11, "tebd_input_mode": "strip",
                "set_davg_zero": False, "exclude_types": [[2, 2]]},
}  # fmt: skip


def build(config: dict, seed: int):
    cls = DescriptorSeE3Tebd if config["type"] == "se_e3_tebd" else DescriptorSeAtten
    desc = cls.from_config({**config, "seed": seed}, ntypes=3, type_map=["O", "H", "C"])
    rng = np.random.default_rng(seed)
    davg = np.zeros((3, desc.nnei, 4))
    davg[:, :, 0] = rng.uniform(0.1, 0.4, (3, 1))
    dstd = np.repeat(rng.uniform(0.1, 0.5, (3, 1, 2)), [1, 3], axis=2).repeat(desc.nnei, 1)
    desc.set_stats(torch.as_tensor(davg), torch.as_tensor(dstd))
    return desc


def descriptor(desc, group: str) -> np.ndarray:
    frames = fixture.frames(group)
    nlist, shift = fixture.mixed_inputs(frames["coord"], frames["box"], desc.rcut, desc.nnei)
    box = None if frames["box"] is None else torch.as_tensor(frames["box"])
    diff = fixture.pair_diff(torch.as_tensor(frames["coord"]), box, nlist, shift)
    with torch.no_grad():
        return desc(diff, nlist, torch.as_tensor(frames["atype"])).double().numpy()


@pytest.mark.parametrize("backend", ["numpy", "pt"])
def test_deepmd_reads_our_descriptors(backend: str, request, tmp_path) -> None:
    """``numpy``: DeePMD-kit's reference implementation (``MDTRAIN_DEEPMD_PYTHON``); ``pt``:
    its PyTorch backend, the one ``dp --pt`` runs (``MDTRAIN_DEEPMD_PT_PYTHON``), whose own
    serialisation mdtrain then reads back to the same descriptor."""
    deepmd = request.getfixturevalue("deepmd" if backend == "numpy" else "deepmd_pt")
    built = {name: build(config, seed) for seed, (name, config) in enumerate(CASES.items())}
    models = {"names": np.array(json.dumps(list(built)))}
    for name, desc in built.items():
        models.update(entries(name, desc.to_deepmd()))
    np.savez(tmp_path / "models.npz", **models)
    frames = {"groups": np.array(json.dumps(list(fixture.GROUPS)))}
    for group in fixture.GROUPS:
        for key, value in fixture.frames(group).items():
            if value is not None:
                frames[f"{group}/{key}"] = value
    np.savez(tmp_path / "frames.npz", **frames)
    job = {"models": "models.npz", "frames": "frames.npz", "out": "out.npz", "backend": backend}
    (tmp_path / "job.json").write_text(json.dumps(job))
    deepmd.run([deepmd.python, DRIVER, "job.json"], tmp_path)
    out = np.load(tmp_path / "out.npz")
    for name, desc in built.items():
        tol = 1e-5 if desc.dtype == torch.float32 else 1e-10
        for group in fixture.GROUPS:
            got, want = descriptor(desc, group), out[f"{name}/{group}"]
            assert rel_diff(got, want) < tol, (name, group, rel_diff(got, want))
        again = read(out, f"{name}/again")
        back = type(desc).from_deepmd_dict(again)  # DeePMD-kit's own dict, read by mdtrain
        for group in fixture.GROUPS:
            assert rel_diff(descriptor(back, group), out[f"{name}/{group}"]) < tol, (name, group)
        ours = desc.to_deepmd()
        assert again.keys() == ours.keys(), name
        for key in ours:
            if key not in (
                "@variables",
                "embeddings",
                "embeddings_strip",
                "type_embedding",
                "attention_layers",
            ):
                assert again[key] == ours[key], (name, key)
    for kind, ours in (
        ("se_atten", DEFAULTS),
        ("se_atten_v2", V2_DEFAULTS),
        ("se_e3_tebd", E3_DEFAULTS),
    ):
        theirs = json.loads(str(out[f"defaults/{kind}"]))
        theirs.pop("sel")
        assert {k: ours[k] for k in theirs} == theirs, kind
        # the keys argcheck leaves out when unset (no default): ours hold None
        unset = set(ours) - set(theirs)
        assert unset == (set() if kind == "se_e3_tebd" else {"lmax", "temperature"}), kind
        assert all(ours[k] is None for k in unset), kind
