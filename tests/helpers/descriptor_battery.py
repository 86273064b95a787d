"""The small descriptor settings the descriptor battery (``tests/model/
test_descriptor_battery.py``) runs every registered descriptor with. A descriptor added to
the registry without an entry here fails the battery: add its tiny settings (a few neurons,
``sel`` for the test frames: O-H water within 3.5 Å)."""

from __future__ import annotations

import copy

BATTERY: dict[str, dict] = {
    "se_e2_a": {
        "type": "se_e2_a",
        "sel": [16, 32],
        "rcut": 3.5,
        "rcut_smth": 0.5,
        "neuron": [4, 8],
        "axis_neuron": 4,
        "resnet_dt": True,
        "seed": 1,
    },
    "se_e2_r": {
        "type": "se_e2_r",
        "sel": [16, 32],
        "rcut": 3.5,
        "rcut_smth": 0.5,
        "neuron": [4, 8],
        "resnet_dt": True,
        "seed": 1,
    },
    "se_e3": {
        "type": "se_e3",
        "sel": [8, 16],
        "rcut": 3.0,
        "rcut_smth": 0.5,
        "neuron": [2, 4],
        "resnet_dt": True,
        "seed": 1,
    },
    "hybrid": {
        "type": "hybrid",
        "list": [
            {"type": "se_e2_a", "sel": [8, 28], "rcut": 2.5, "rcut_smth": 0.4, "neuron": [4, 8]},
            {"type": "se_e2_r", "sel": [16, 24], "rcut": 3.5, "rcut_smth": 0.5, "neuron": [3, 6]},
        ],
    },
    # the type-embedding descriptors: one type-mixed list, sel for all types together
    "se_atten": {
        "type": "se_atten",
        "sel": 48,
        "rcut": 3.5,
        "rcut_smth": 0.5,
        "neuron": [4, 8],
        "axis_neuron": 2,
        "tebd_dim": 3,
        "attn": 6,
        "attn_layer": 1,
        "seed": 1,
    },
    "se_atten_v2": {
        "type": "se_atten_v2",
        "sel": 48,
        "rcut": 3.5,
        "rcut_smth": 0.5,
        "neuron": [4, 8],
        "axis_neuron": 2,
        "tebd_dim": 3,
        "attn": 6,
        "attn_layer": 1,
        "seed": 1,
    },
    "se_e3_tebd": {
        "type": "se_e3_tebd",
        "sel": 24,
        "rcut": 3.0,
        "rcut_smth": 0.5,
        "neuron": [4, 6],
        "tebd_dim": 3,
        "seed": 1,
    },
}
# Other member lists a hybrid runs the battery with (variant {"members": name}): type-mixed
# members beside per-type ones make the hybrid type-mixed (one list over all types, from
# which the per-type members' blocks are drawn). The rcuts and sels differ so that members
# see neighbours beyond their own rcut and blocks cut short.
HYBRID_MEMBERS: dict[str, list[dict]] = {
    "mixed": [
        {
            "type": "se_atten",
            "sel": 30,
            "rcut": 3.0,
            "rcut_smth": 0.4,
            "neuron": [4, 8],
            "axis_neuron": 2,
            "tebd_dim": 3,
            "attn": 6,
            "attn_layer": 1,
        },
        {"type": "se_e2_a", "sel": [8, 16], "rcut": 3.5, "rcut_smth": 0.5, "neuron": [4, 6]},
    ],
    "mixed-tebd": [
        {
            "type": "se_e2_r",
            "sel": [6, 20],
            "rcut": 2.8,
            "rcut_smth": 0.5,
            "neuron": [3, 6],
            "type_one_side": True,  # (false has no .dp form)
        },
        {
            "type": "se_e3_tebd",
            "sel": 16,
            "rcut": 2.6,
            "rcut_smth": 0.5,
            "neuron": [3, 4],
            "tebd_dim": 2,
        },
        {
            "type": "se_atten_v2",
            "sel": 40,
            "rcut": 3.5,
            "rcut_smth": 0.5,
            "neuron": [4, 6],
            "axis_neuron": 2,
            "tebd_dim": 3,
            "attn": 4,
            "attn_layer": 1,
        },
    ],
}
# Variants each run too: settings that change the arithmetic.
VARIANTS: dict[str, list[dict]] = {
    "se_e2_a": [{"type_one_side": True}, {"type_one_side": False}],
    "se_e2_r": [{"type_one_side": True}, {"type_one_side": False}],
    "hybrid": [
        {"type_one_side": True},
        {"type_one_side": False},
        *({"members": name} for name in HYBRID_MEMBERS),
    ],
    "se_atten": [
        {"tebd_input_mode": "concat"},
        {"tebd_input_mode": "strip", "smooth_type_embedding": True, "type_one_side": True},
    ],
    "se_e3_tebd": [{"tebd_input_mode": "concat"}, {"tebd_input_mode": "strip"}],
}
# Settings of the members of a descriptor made of others (hybrid), not of itself.
MEMBER_KEYS = {"hybrid": "list"}


def battery_config(name: str, variant: dict | None = None, **descriptor) -> dict:
    """The model section of a tiny model with descriptor ``name`` (settings overridden)."""
    desc = copy.deepcopy(BATTERY[name])
    settings = {**(variant or {}), **descriptor}
    if "members" in settings:  # another member list (HYBRID_MEMBERS)
        desc[MEMBER_KEYS[name]] = copy.deepcopy(HYBRID_MEMBERS[settings.pop("members")])
    if name in MEMBER_KEYS:  # every member takes the settings (type_one_side: those with it)
        for k, member in enumerate(desc[MEMBER_KEYS[name]]):
            member.update(seed=k + 1, resnet_dt=True)
            member.update({key: v for key, v in settings.items() if key != "type"})
        desc.update({key: v for key, v in settings.items() if key == "type"})
    else:
        desc.update(settings)
    return {
        "type_map": ["O", "H"],
        "descriptor": desc,
        "fitting_net": {"neuron": [8, 8], "resnet_dt": True, "seed": 2},
    }


def battery_cases() -> list[tuple[str, dict]]:
    """(descriptor, variant) of every registered descriptor: what the battery runs."""
    from mdtrain.model.descriptors import DESCRIPTORS

    return [(name, v) for name in DESCRIPTORS for v in VARIANTS.get(name, [{}])]


def layout_cases() -> list[tuple[str, dict]]:
    """Every registered descriptor with its own settings, and the hybrids of other member
    lists (their neighbour list differs): what the slower tests (training, freezing) run."""
    from mdtrain.model.descriptors import DESCRIPTORS

    plain = [(name, {}) for name in DESCRIPTORS]
    return plain + [("hybrid", {"members": name}) for name in HYBRID_MEMBERS]


def case_id(case: tuple[str, dict]) -> str:
    name, variant = case
    return name + "".join(f"-{k}={v}" for k, v in variant.items())
