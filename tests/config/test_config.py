"""Config loading: JSON errors, comments, aliases, defaults, and one message per problem."""

from __future__ import annotations

import copy
import json
import os

import pytest
from jsonschema import Draft202012Validator

from mdtrain.config import (
    dump_config,
    load_config,
    normalize_config,
    resolve_path,
    validate_config,
)
from mdtrain.errors import MDTrainError
from mdtrain.schema import load_schema

# The shape of a typical DeePMD-style water input (written here, not copied from any file).
WATER = {
    "_comment": "top-level comment",
    "model": {
        "type_map": ["O", "H"],
        "descriptor": {
            "type": "se_e2_a",
            "sel": [46, 92],
            "rcut_smth": 0.50,
            "rcut": 6.00,
            "neuron": [25, 50, 100],
            "resnet_dt": False,
            "axis_neuron": 16,
            "type_one_side": True,
            "seed": 1,
            "_comment": "descriptor",
        },
        "fitting_net": {"neuron": [240, 240, 240], "resnet_dt": True, "seed": 1},
        "data_stat_nbatch": 20,
    },
    "learning_rate": {"type": "exp", "decay_steps": 100, "start_lr": 0.001, "stop_lr": 3.51e-8},
    "loss": {
        "type": "ener",
        "start_pref_e": 0.02,
        "limit_pref_e": 1,
        "start_pref_f": 1000,
        "limit_pref_f": 1,
        "start_pref_v": 0,
        "limit_pref_v": 0,
    },
    "training": {
        "stat_file": "./water.hdf5",
        "training_data": {"systems": ["data_0", "data_1", "data_2"], "batch_size": 1},
        "validation_data": {"systems": ["data_3"], "batch_size": 1, "numb_btch": 3},
        "numb_steps": 2000,
        "seed": 10,
        "disp_file": "lcurve.out",
        "disp_freq": 100,
        "save_freq": 1000,
    },
}


def water(**changes) -> dict:
    """A copy of WATER with ``{"a.b.c": value}`` changes (value None-sentinel deletes)."""
    data = copy.deepcopy(WATER)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for part in parents:
            node = node[part]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return data


_DELETE = object()


def problems_of(data) -> list[str]:
    return validate_config(data)


def single_problem(data) -> str:
    found = problems_of(data)
    assert len(found) == 1, found
    return found[0]


# --- the schema itself ----------------------------------------------------------------------


def test_schema_is_valid_draft_2020_12():
    Draft202012Validator.check_schema(load_schema())


def _properties(node, root, path=""):
    from mdtrain.schema import resolve

    node = resolve(node, root)
    for name, sub in node.get("properties", {}).items():
        yield f"{path}.{name}" if path else name, resolve(sub, root)
        yield from _properties(sub, root, f"{path}.{name}" if path else name)
    for branch in node.get("anyOf", []) if node.get("x-discriminator") else []:
        yield from _properties(branch, root, path)


def test_every_property_has_a_description_and_defaults_validate():
    schema = load_schema()
    validator = Draft202012Validator(schema)
    for path, node in _properties(schema, schema):
        assert node.get("description"), f"{path} has no description"
        if "default" in node:
            sub = Draft202012Validator({**node, "$defs": schema["$defs"]})
            assert sub.is_valid(node["default"]), f"{path}: default {node['default']!r} invalid"
    assert validator.is_valid(normalize_config(WATER, "input.json"))


# --- accepted input, defaults, comments, aliases --------------------------------------------


def test_water_style_input_is_accepted_and_completed():
    config = normalize_config(WATER, "input.json")
    desc = config["model"]["descriptor"]
    assert desc["sel"] == [46, 92]
    assert desc["activation_function"] == "tanh"
    assert desc["precision"] == "default"
    assert desc["exclude_types"] == []
    assert config["model"]["fitting_net"]["type"] == "ener"
    assert config["model"]["fitting_net"]["activation_function"] == "tanh"
    assert config["model"]["data_stat_nbatch"] == 20
    assert config["model"]["data_stat_protect"] == 0.01
    assert config["learning_rate"]["decay_rate"] is None
    assert config["training"]["save_ckpt"] == "model.ckpt"
    assert config["training"]["max_ckpt_keep"] == 5
    assert config["training"]["validation_data"]["auto_prob"] == "prob_sys_size"
    assert config["training"]["distributed"] == {
        "backend": "auto",
        "fallback": True,
        "stat_mode": "rank0",
        "timeout": 1800,
        "overlap_comm": True,
        "bucket_mb": 2,
    }
    assert config["training"]["batch_controller"] == {
        "grow": False,
        "retry_interval": 200,
        "micro_batches": None,
    }
    assert config["training"]["strict_sel"] is False
    assert config["training"]["restart"] is None
    # numbers are given the schema's type
    assert isinstance(config["loss"]["limit_pref_e"], float)
    assert isinstance(config["training"]["numb_steps"], int)


def test_input_is_not_modified():
    data = copy.deepcopy(WATER)
    normalize_config(data, "input.json")
    assert data == WATER


def test_missing_optional_sections_get_their_defaults():
    data = water(loss=_DELETE, learning_rate=_DELETE, model__fitting_net=_DELETE)
    data["training"].pop("validation_data")
    config = normalize_config(data, "input.json")
    assert config["loss"] == {
        "type": "ener",
        "start_pref_e": 0.02,
        "limit_pref_e": 1.0,
        "start_pref_f": 1000.0,
        "limit_pref_f": 1.0,
        "start_pref_v": 0.0,
        "limit_pref_v": 0.0,
        # DeePMD-kit 3.2's defaults of the loss options: every one off
        **dict.fromkeys(
            [f"{w}_pref_{x}" for x in ("ae", "pf", "gf") for w in ("start", "limit")], 0.0
        ),
        "use_default_pf": False,
        "numb_generalized_coord": 0,
        "relative_f": None,
        "enable_atom_ener_coeff": False,
        "use_huber": False,
        "huber_delta": 0.01,
        "loss_func": "mse",
        "f_use_norm": False,
        "intensive_ener_virial": False,
        "start_pref_h": 0.0,
        "limit_pref_h": 0.0,
    }
    assert config["learning_rate"]["start_lr"] == 1e-3
    assert config["learning_rate"]["stop_lr"] is None  # 5e-8 unless stop_lr_ratio (lr.py)
    assert config["learning_rate"]["decay_steps"] == 5000
    assert config["model"]["fitting_net"]["neuron"] == [120, 120, 120]
    assert config["model"]["fitting_net"]["resnet_dt"] is True
    assert config["training"]["validation_data"] is None
    desc = normalize_config(water(model__descriptor={"type": "se_e2_a"}), "input.json")["model"][
        "descriptor"
    ]
    assert desc["sel"] == "auto"
    assert (desc["rcut"], desc["rcut_smth"], desc["axis_neuron"]) == (6.0, 0.5, 4)
    assert desc["neuron"] == [10, 20, 40]


def test_defaults_are_not_shared_between_calls():
    first = normalize_config(water(), "input.json")
    first["model"]["descriptor"]["exclude_types"].append([0, 1])
    second = normalize_config(water(), "input.json")
    assert second["model"]["descriptor"]["exclude_types"] == []


def test_comment_keys_are_dropped_at_every_level():
    data = water()
    data["model"]["fitting_net"]["_note"] = {"nested": True}
    data["training"]["training_data"]["_x"] = 1
    data["loss"]["__private"] = "y"
    config = normalize_config(data, "input.json")

    def keys(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield k
                yield from keys(v)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)

    assert not [k for k in keys(config) if k.startswith("_")]


def test_aliases_are_resolved():
    data = water()
    desc = data["model"]["descriptor"]
    desc["type"] = "se_a"
    desc["n_axis_neuron"] = desc.pop("axis_neuron")
    data["model"]["fitting_net"]["n_neuron"] = data["model"]["fitting_net"].pop("neuron")
    data["training"]["stop_batch"] = data["training"].pop("numb_steps")
    data["training"]["training_data"]["auto_prob_style"] = "prob_uniform"
    config = normalize_config(data, "input.json")
    assert config["model"]["descriptor"]["type"] == "se_e2_a"
    assert config["model"]["descriptor"]["axis_neuron"] == 16
    assert "n_axis_neuron" not in config["model"]["descriptor"]
    assert config["model"]["fitting_net"]["neuron"] == [240, 240, 240]
    assert config["training"]["numb_steps"] == 2000
    assert config["training"]["training_data"]["auto_prob"] == "prob_uniform"

    data = water()
    data["training"]["num_steps"] = data["training"].pop("numb_steps")
    assert normalize_config(data, "input.json")["training"]["numb_steps"] == 2000


def test_alias_and_name_together_is_a_problem():
    data = water()
    data["model"]["fitting_net"]["n_neuron"] = [10]
    message = single_problem(data)
    assert message.startswith("model.fitting_net.neuron: given twice")
    assert "n_neuron" in message


def test_sel_auto_forms_and_batch_size_forms():
    for sel in ("auto", "auto:1.5", "auto:2", [0, 4]):
        config = normalize_config(water(model__descriptor__sel=sel), "input.json")
        assert config["model"]["descriptor"]["sel"] == sel
    for batch in ("auto", "auto:64", 3, [1, 2, 3]):
        data = water()
        data["training"]["training_data"]["batch_size"] = batch
        assert validate_config(data) == []
    for bad in ("auto:", "automatic", "auto:-1", "auto:x"):
        message = single_problem(water(model__descriptor__sel=bad))
        assert message.startswith("model.descriptor.sel: expected"), message
    assert "ratio" in single_problem(water(model__descriptor__sel="auto:0"))


def test_integral_float_counts_become_ints():
    config = normalize_config(water(training__numb_steps=1e5), "input.json")
    assert config["training"]["numb_steps"] == 100000
    assert type(config["training"]["numb_steps"]) is int


# --- problems: unknown keys, types, ranges, cross-field ----------------------------------------


def test_unknown_key_names_path_and_suggests():
    data = water()
    data["model"]["descriptor"]["rcut_smht"] = data["model"]["descriptor"].pop("rcut_smth")
    message = single_problem(data)
    assert message == "model.descriptor.rcut_smht: unknown key; did you mean 'rcut_smth'?"
    message = single_problem(water(trainnig={}))
    assert message == "trainnig: unknown key; did you mean 'training'?"


def test_unknown_key_without_close_match_lists_valid_keys():
    message = single_problem(water(loss__zzz=1))
    assert message.startswith("loss.zzz: unknown key; valid keys: type, start_pref_e")


def test_wrong_type_names_path_and_expected_type():
    assert (
        single_problem(water(model__descriptor__rcut="6"))
        == 'model.descriptor.rcut: expected a number, got "6"'
    )
    assert (
        single_problem(water(model__descriptor__resnet_dt=1))
        == "model.descriptor.resnet_dt: expected true or false, got 1"
    )
    assert single_problem(water(training__numb_steps=10.5)) == (
        "training.numb_steps: expected an integer, got 10.5"
    )
    assert single_problem(water(model__descriptor__sel=4.5)).startswith(
        "model.descriptor.sel: expected a list of integers"
    )
    # an integer is a sel, but only for the descriptors with one type-mixed neighbour list
    assert single_problem(water(model__descriptor__sel=46)) == (
        "model.descriptor.sel: one integer for all types is taken only by se_atten, dpa1, "
        "se_atten_v2, se_e3_tebd; se_e2_a needs a list with one entry per element of "
        'model.type_map (or "auto")'
    )


def test_out_of_range_values_name_the_bound():
    assert single_problem(water(model__descriptor__rcut=-1.0)) == (
        "model.descriptor.rcut: must be > 0, got -1.0"
    )
    assert single_problem(water(model__descriptor__sel=[46, -1])) == (
        "model.descriptor.sel[1]: must be >= 0, got -1"
    )
    assert single_problem(water(model__descriptor__neuron=[25, 0, 100])) == (
        "model.descriptor.neuron[1]: must be >= 1, got 0"
    )
    assert single_problem(water(learning_rate__decay_rate=1.5)) == (
        "learning_rate.decay_rate: must be <= 1, got 1.5"
    )
    assert single_problem(water(learning_rate__start_lr=0)) == (
        "learning_rate.start_lr: must be > 0, got 0.0"
    )
    assert single_problem(water(training__numb_steps=-1)) == (
        "training.numb_steps: must be >= 0, got -1"
    )
    data = water()
    data["training"]["training_data"]["batch_size"] = 0
    assert single_problem(data) == "training.training_data.batch_size: must be >= 1, got 0"


def test_enum_choices_and_suggestion():
    message = single_problem(water(model__descriptor__activation_function="tanhh"))
    assert message.startswith('model.descriptor.activation_function: must be one of "tanh"')
    assert message.endswith('did you mean "tanh"?')
    message = single_problem(water(model__descriptor__type="se_e3_bogus"))
    assert message.startswith('model.descriptor.type: "se_e3_bogus" is not supported; supported: ')
    assert "se_e2_a (alias se_a)" in message
    message = single_problem(water(model__fitting_net__numb_fparam=-1))
    assert message.startswith("model.fitting_net.numb_fparam")


def test_missing_required_keys():
    data = water(model__descriptor__sel="auto")
    del data["model"]["type_map"]
    del data["training"]["numb_steps"]
    found = problems_of(data)
    assert any(p.startswith("model.type_map: missing; without it the types are") for p in found)
    assert "training: give numb_steps or numb_epoch (the length of the training)" in found
    assert len(found) == 2


def test_missing_type_map_takes_type_raw_indices(caplog):
    """As in DeePMD-kit: without type_map, as many types as sel has entries, names unknown."""
    data = water(model__descriptor__sel=[20, 40])
    del data["model"]["type_map"]
    config = normalize_config(data, "input.json")
    assert config["model"]["type_map"] == ["type_0", "type_1"]
    assert "model.type_map is not given" in caplog.text


def test_rcut_smth_must_be_below_rcut():
    for smth in (6.0, 7.5):
        message = single_problem(water(model__descriptor__rcut_smth=smth))
        assert message == f"model.descriptor.rcut_smth: must be smaller than rcut (6.0), got {smth}"


def test_other_cross_field_checks():
    assert single_problem(water(model__descriptor__sel=[46, 92, 3])) == (
        "model.descriptor.sel: needs one entry per element of model.type_map (2), got 3"
    )
    assert single_problem(water(learning_rate__stop_lr=0.01)) == (
        "learning_rate.stop_lr: must not exceed start_lr (0.001), got 0.01"
    )
    assert "last neuron width (100)" in single_problem(water(model__descriptor__axis_neuron=128))
    assert "type 2 is not in model.type_map" in single_problem(
        water(model__descriptor__exclude_types=[[0, 2]])
    )
    zero = {k: 0 for k in WATER["loss"] if k.endswith(("_e", "_f", "_v"))}
    assert "nothing to train on" in single_problem(water(loss=zero))
    # one non-zero prefactor per term trains nothing either (DeePMD-kit's PyTorch backend)
    one_sided = {**zero, "start_pref_e": 0.02, "limit_pref_f": 1.0}
    assert "nothing to train on" in single_problem(water(loss=one_sided))


def test_all_problems_are_listed_with_a_summary():
    data = water(model__descriptor__rcut=-1.0, learning_rate__decay_rate=2.0)
    data["model"]["descriptor"]["rcut_smht"] = 0.5
    with pytest.raises(MDTrainError) as info:
        normalize_config(data, "input.json")
    lines = str(info.value).splitlines()
    assert lines[0] == "input.json: 3 problems"
    assert len(lines) == 4
    assert any("model.descriptor.rcut_smht: unknown key" in line for line in lines)
    assert any("model.descriptor.rcut: must be > 0" in line for line in lines)
    assert any("learning_rate.decay_rate: must be <= 1" in line for line in lines)


def test_single_problem_is_a_single_line():
    with pytest.raises(MDTrainError) as info:
        normalize_config(water(model__descriptor__rcut=-1.0), "in.json")
    assert str(info.value) == "in.json: model.descriptor.rcut: must be > 0, got -1.0"


def test_top_level_must_be_an_object():
    assert validate_config([1, 2]) == ["(top level): expected an object, got [1, 2]"]


# --- files ------------------------------------------------------------------------------------


def test_load_config_reads_and_reports_json_syntax(tmp_path):
    good = tmp_path / "input.json"
    good.write_text(json.dumps(WATER, indent=2))
    assert load_config(good)["training"]["numb_steps"] == 2000

    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "model": {\n    "type_map": ["O", "H"],\n  }\n}\n')
    with pytest.raises(MDTrainError) as info:
        load_config(bad)
    message = str(info.value)
    assert message.startswith(f"{bad}: invalid JSON at line 4 column 3:")
    assert "\n" not in message

    with pytest.raises(MDTrainError, match="no such file"):
        load_config(tmp_path / "missing.json")


def test_repeated_key_warns(tmp_path, caplog):
    path = tmp_path / "input.json"
    text = json.dumps(WATER).replace('"numb_steps": 2000', '"numb_steps": 5, "numb_steps": 2000')
    path.write_text(text)
    logger = __import__("logging").getLogger("mdtrain")
    logger.addHandler(caplog.handler)
    try:
        config = load_config(path)
    finally:
        logger.removeHandler(caplog.handler)
    assert config["training"]["numb_steps"] == 2000
    assert "'numb_steps' appears twice" in caplog.text


def test_resolve_path(tmp_path):
    cfg = str(tmp_path / "sub" / "input.json")
    base = str(tmp_path / "sub")
    assert resolve_path(cfg, "data_0") == os.path.join(base, "data_0")
    assert resolve_path(cfg, "./water.hdf5") == os.path.join(base, "water.hdf5")
    assert resolve_path(cfg, "../d.h5#/sys/a") == os.path.join(str(tmp_path), "d.h5") + "#/sys/a"
    assert resolve_path(cfg, "/abs/x.h5#/g") == "/abs/x.h5#/g"


def test_dump_config_round_trips(tmp_path):
    config = normalize_config(WATER, "input.json")
    out = tmp_path / "out.json"
    dump_config(config, out)
    assert json.loads(out.read_text()) == config
    assert normalize_config(json.loads(out.read_text()), str(out)) == config
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_key_at_the_wrong_level_names_where_it_belongs():
    data = water()
    data["model"]["rcut"] = 6.0
    assert single_problem(data) == "model.rcut: unknown key; it belongs in model.descriptor"


def test_unimplemented_deepmd_options_only_at_their_off_value():
    data = water(
        training__profiling=False,
        model__atom_exclude_types=[],
    )
    data["training"]["training_data"]["rglob_patterns"] = None
    config = normalize_config(data, "input.json")
    assert "profiling" not in config["training"]
    assert "rglob_patterns" not in config["training"]["training_data"]

    assert single_problem(water(training__profiling=True)) == (
        "training.profiling: not supported by mdtrain; remove it or set it to false, got true"
    )
    # JSON false is not 0
    assert "not supported" in single_problem(water(training__disp_avg=0))
    # the loss options are supported now (tests/train/test_loss_options.py); not the Hessian
    assert single_problem(water(loss__start_pref_h=1)).startswith(
        "loss.start_pref_h: must be 0 (the Hessian loss is not supported"
    )
