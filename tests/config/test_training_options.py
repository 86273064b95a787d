"""The DeePMD-kit 3.2 training options in the input: keys, aliases, type-dependent keys and
defaults, and conflicting keys reported in one line naming both."""

import copy

import pytest

from mdtrain.config.loader import complete_config

BASE = {
    "model": {
        "type_map": ["O", "H"],
        "descriptor": {"type": "se_e2_a", "sel": [4, 8], "rcut": 4.0, "rcut_smth": 0.5},
    },
    "loss": {"start_pref_e": 1, "limit_pref_e": 1, "start_pref_f": 1, "limit_pref_f": 1},
    "training": {
        "training_data": {"systems": ["a"]},
        "validation_data": {"systems": ["b"]},
        "numb_steps": 100,
    },
}


def complete(**sections):
    data = copy.deepcopy(BASE)
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(name), dict):
            data[name].update(value)
        else:
            data[name] = value
    return complete_config(data)


def problems(**sections):
    return complete(**sections)[1]


@pytest.mark.parametrize(
    "section, first, second",
    [
        (
            {"learning_rate": {"warmup_steps": 10, "warmup_ratio": 0.1}},
            "warmup_steps",
            "warmup_ratio",
        ),
        ({"learning_rate": {"stop_lr": 1e-6, "stop_lr_ratio": 0.01}}, "stop_lr", "stop_lr_ratio"),
        ({"training": {"numb_epoch": 2}}, "numb_steps", "numb_epoch"),
        ({"training": {"num_epoch": 2, "numb_steps": 5}}, "numb_steps", "numb_epoch"),
    ],
)
def test_conflicting_keys_are_one_line_naming_both(section, first, second):
    found = problems(**section)
    assert len(found) == 1, found
    assert first in found[0] and second in found[0] and "\n" not in found[0]


def test_length_in_epochs_and_its_aliases():
    for alias in ("numb_epoch", "num_epoch", "num_epochs", "numb_epochs"):
        data = copy.deepcopy(BASE)
        del data["training"]["numb_steps"]
        data["training"][alias] = 1.5
        config, found = complete_config(data)
        assert not found and config["training"]["numb_epoch"] == 1.5
    for alias in ("num_step", "numb_step", "num_steps", "stop_batch"):
        data = copy.deepcopy(BASE)
        data["training"][alias] = data["training"].pop("numb_steps")
        assert complete_config(data)[0]["training"]["numb_steps"] == 100
    data = copy.deepcopy(BASE)
    del data["training"]["numb_steps"]
    assert complete_config(data)[1] == [
        "training: give numb_steps or numb_epoch (the length of the training)"
    ]


def test_keys_of_one_schedule_type_only():
    config, found = complete(learning_rate={"type": "cosine", "warmup_ratio": 0.1})
    assert not found
    assert "decay_steps" not in config["learning_rate"] and "smooth" not in config["learning_rate"]
    assert config["learning_rate"]["warmup_start_factor"] == 0.0
    assert problems(learning_rate={"type": "cosine", "decay_steps": 10}) == [
        'learning_rate.decay_steps: only for type "exp", not "cosine"'
    ]
    assert problems(learning_rate={"decay_type": "linear"}) == [
        'learning_rate.decay_type: only for type "wsd", not "exp"'
    ]
    config, found = complete(learning_rate={"type": "wsd", "decay_type": "cosine"})
    assert not found and config["learning_rate"]["decay_phase_ratio"] == 0.1
    assert "wsd" in problems(learning_rate={"type": "wsd", "stop_lr": 0})[0]


def test_warmup_must_end_before_the_last_step():
    assert problems(learning_rate={"warmup_steps": 100}) == [
        "learning_rate.warmup_steps: must be smaller than training.numb_steps (100), got 100"
    ]


def test_optimizer_defaults_depend_on_the_type():
    opt = complete()[0]["optimizer"]
    assert opt == {"type": "Adam", "adam_beta1": 0.9, "adam_beta2": 0.999, "weight_decay": 0.0}
    assert complete(optimizer={"type": "AdamW"})[0]["optimizer"]["weight_decay"] == 0.001
    muon = complete(optimizer={"type": "AdaMuon", "muon_momentum": 0.9})[0]["optimizer"]
    assert muon == {
        "type": "AdaMuon", "adam_beta1": 0.9, "adam_beta2": 0.95, "weight_decay": 0.001,
        "momentum": 0.9, "lr_adjust": 10.0, "lr_adjust_coeff": 0.2,
    }  # fmt: skip
    assert problems(optimizer={"type": "Adam", "momentum": 0.9}) == [
        'optimizer.momentum: only for type "AdaMuon" or "HybridMuon", not "Adam"'
    ]


def test_lkf_is_refused_in_one_line():
    found = problems(optimizer={"type": "LKF"})
    assert len(found) == 1 and "\n" not in found[0]
    assert found[0].startswith("optimizer.type: must be") and "LKF" in found[0]


def test_hybrid_muon_keys():
    opt = complete(optimizer={"type": "HybridMuon", "muon_mode": "flat"})[0]["optimizer"]
    assert opt["lr_adjust"] == 0.0 and opt["lr_adjust_coeff"] == 0.18
    assert opt["muon_mode"] == "flat" and opt["magma_muon"] is True
    assert problems(optimizer={"type": "AdaMuon", "muon_mode": "2d"}) == [
        'optimizer.muon_mode: only for type "HybridMuon", not "AdaMuon"'
    ]


def test_full_validation_needs_data_and_a_trained_metric():
    assert not problems(validating={"full_validation": True, "validation_metric": "f:rmse"})
    assert problems(validating={"full_validation": True, "validation_metric": "V:MAE"}) == [
        "validating.validation_metric: V:MAE needs loss.start_pref_v and loss.limit_pref_v "
        "both non-zero"
    ]
    assert problems(validating={"full_validation": True, "validation_metric": "X:MAE"})
    data = copy.deepcopy(BASE)
    data["training"].pop("validation_data")
    data["validating"] = {"full_validation": True}
    assert complete_config(data)[1] == [
        "validating.full_validation: needs training.validation_data"
    ]
    data["validating"]["full_val_start"] = 1  # never runs
    assert not complete_config(data)[1]


def test_scale_by_worker_takes_deepmd_values():
    assert not problems(learning_rate={"scale_by_worker": "sqrt"})
    assert problems(learning_rate={"scale_by_worker": "cubic"})
