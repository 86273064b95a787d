"""The tiny models DeePMD-kit trains for the interop fixtures and tests, one per descriptor
mdtrain reads: their settings, which DeePMD-kit backend trains them (its TensorFlow backend
where it has the descriptor, its PyTorch one otherwise) and their ``input.json``. Used by
``tests/fixtures/deepmd/make_fixture.py`` (the committed fixtures), ``tests/infer/
test_deepmd_fixture.py`` and ``tests/interop/test_deepmd_trained.py``."""

from __future__ import annotations

from tests.helpers.deepmd import deepmd_input

RCUT = 4.0  # the cut-off of deepmd_input()
_TEBD = {"rcut": RCUT, "rcut_smth": 0.5, "neuron": [4, 8], "tebd_dim": 4, "seed": 1}
_ATTEN = {**_TEBD, "sel": 48, "axis_neuron": 4, "attn": 8, "attn_layer": 1}
# variant -> (descriptor settings, fitting settings, backend); "type" given: the whole section
VARIANTS = {
    "se_e2_a_one_side": ({"type_one_side": True, "resnet_dt": False}, {}, "tf"),
    "se_e2_a_two_side": (
        {"type_one_side": False, "resnet_dt": True, "exclude_types": [[1, 1]]},
        {"activation_function": "gelu"},
        "tf",
    ),
    # se_e2_r and se_e3: DeePMD-kit 3.2.0's TensorFlow backend evaluates them differently
    # from its numpy and PyTorch ones (the .pb of a TensorFlow-trained model and its .dp
    # disagree), so its PyTorch backend trains them. se_e2_r type_one_side: the numpy and
    # PyTorch backends build no other
    "se_e2_r": (
        {"type": "se_e2_r", "rcut": RCUT, "rcut_smth": 0.5, "sel": [16, 32], "neuron": [4, 8],
         "type_one_side": True},
        {},
        "pt",
    ),
    "se_e3": (
        {"type": "se_e3", "rcut": RCUT, "rcut_smth": 0.5, "sel": [16, 32], "neuron": [2, 4]},
        {},
        "pt",
    ),
    # DeePMD-kit 3.2.0's TensorFlow backend trains se_atten but cannot write it as .dp
    # (dp convert-backend frozen_model.pb model.dp: "Object of type int64 is not JSON
    # serializable"), so these two are trained by its PyTorch backend. (Named by the alias:
    # se_atten.npz is the descriptor fixture of tests/model/test_se_atten.py.)
    "dpa1": ({"type": "se_atten", **_ATTEN}, {}, "pt"),
    "se_atten_v2": ({"type": "se_atten_v2", **_ATTEN}, {}, "pt"),
    "se_e3_tebd": ({"type": "se_e3_tebd", **_TEBD, "sel": 24, "neuron": [2, 4]}, {}, "pt"),
    "hybrid": (
        {
            "type": "hybrid",
            "list": [
                {"type": "se_e2_a", "rcut": 3.0, "rcut_smth": 0.5, "sel": [8, 16],
                 "neuron": [4, 8], "axis_neuron": 4, "seed": 1},
                {"type": "se_e2_r", "rcut": RCUT, "rcut_smth": 0.5, "sel": [16, 32],
                 "neuron": [4, 8], "type_one_side": True, "seed": 2},
            ],
        },
        {},
        "tf",
    ),
}  # fmt: skip
# backend -> (its dp flag, the frozen model's suffix)
BACKENDS = {"tf": ("--tf", ".pb"), "pt": ("--pt", ".pth")}


def training_input(descriptor: dict, fitting: dict) -> dict:
    """`deepmd_input` with these settings; a descriptor section with a ``type`` replaces
    the se_e2_a one whole (other descriptors take other keys)."""
    if "type" not in descriptor:
        return deepmd_input(descriptor, fitting)
    config = deepmd_input(None, fitting)
    section = dict(descriptor)
    if "list" in section:  # a hybrid: its members have the precision
        section["list"] = [{"precision": "float64", **m} for m in section["list"]]
    else:
        section.setdefault("precision", "float64")
    config["model"]["descriptor"] = section
    return config
