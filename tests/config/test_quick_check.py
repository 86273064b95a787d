"""The quick schema check never calls valid what jsonschema rejects, and takes valid inputs
without jsonschema (config/quick_check.py)."""

from __future__ import annotations

import copy
import json
import math
import os
import random

import pytest
from jsonschema import Draft202012Validator

from mdtrain.config import complete_config
from mdtrain.config.quick_check import surely_valid
from mdtrain.schema import load_schema

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "water", "input.json")
SCHEMA = load_schema()
VALIDATOR = Draft202012Validator(SCHEMA)

# values put in place of a config's leaves: wrong types, bounds, empty, NaN, bool for int ...
REPLACEMENTS = [0, 0.0, 1, 1.0, -1, -1.5, 2.5, 10**6, True, False, None, "", "x", "auto",
                "auto:1.2", "tanh", "float64", [], [0], [1, 1], [1.0, 1], [True, 1], ["a", "a"],
                {}, {"type": "x"}, math.nan, math.inf, -math.inf]  # fmt: skip


def _configs() -> list[dict]:
    """The water example, the same with a type-mixed descriptor and rcut as an integer,
    and with a hybrid descriptor."""
    with open(EXAMPLE, encoding="utf-8") as handle:
        example = json.load(handle)
    mixed = copy.deepcopy(example)
    mixed["model"]["descriptor"] = {"type": "se_atten", "sel": 120, "rcut": 6,
                                    "rcut_smth": 0.5, "attn_layer": 1}  # fmt: skip
    hybrid = copy.deepcopy(example)
    hybrid["model"]["descriptor"] = {
        "type": "hybrid",
        "list": [{"type": "se_e2_a", "sel": [10, 20], "rcut": 4.0, "rcut_smth": 0.5},
                 {"type": "se_atten", "sel": 30, "rcut": 6.0, "rcut_smth": 0.5}],
    }  # fmt: skip
    return [example, mixed, hybrid]


def _leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for k, value in enumerate(node):
            yield from _leaves(value, (*path, k))
    yield path


def _replaced(config, path, value):
    out = copy.deepcopy(config)
    if not path:
        return value
    node = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize("index", range(3))
def test_valid_inputs_skip_jsonschema(index):
    config, problems = complete_config(_configs()[index])
    assert problems == []
    assert surely_valid(config, SCHEMA)


@pytest.mark.parametrize("index", range(3))
def test_never_valid_where_jsonschema_finds_a_problem(index):
    """Every leaf (and object) of a completed valid input replaced by wrong or edge values,
    an unknown key added, a key removed: whenever the quick check says valid, jsonschema
    agrees. Both answers must occur, or the comparison would prove nothing."""
    config, _ = complete_config(_configs()[index])
    rng = random.Random(index)
    answers = {True: 0, False: 0}
    for path in list(_leaves(config)):
        values = rng.sample(REPLACEMENTS, 3)
        candidates = [_replaced(config, path, v) for v in values]
        if path:
            parent = copy.deepcopy(config)
            node = parent
            for part in path[:-1]:
                node = node[part]
            if isinstance(node, dict):
                del node[path[-1]]  # a key left out (required ones must be caught)
                node["unknown_key"] = 1
                candidates.append(parent)
        for candidate in candidates:
            quick = surely_valid(candidate, SCHEMA)
            answers[quick] += 1
            if quick:
                errors = [e.message for e in VALIDATOR.iter_errors(candidate)]
                assert errors == [], f"{path}: quick check said valid; jsonschema: {errors}"
    assert answers[True] > 20 and answers[False] > 20, answers


@pytest.mark.parametrize(
    ("instance", "schema", "expected"),
    [
        (0.0, {"const": 0}, True),  # JSON Schema: 0 and 0.0 are equal
        (True, {"const": 1}, False),  # ... true and 1 are not
        (1, {"enum": [True, "a"]}, False),
        (math.nan, {"minimum": 0}, False),  # jsonschema lets NaN pass a bound; ask it
        ("x", {"minimum": 0}, True),  # bounds constrain numbers only
        ([1, 1.0], {"uniqueItems": True}, False),
        ([1, True], {"uniqueItems": True}, False),  # stricter than JSON Schema: ask it
        ([1, 2], {"uniqueItems": True}, True),
        ({"a": 1}, {"properties": {"a": {"type": "string"}}}, False),
        ({"a": 1}, {"additionalProperties": False}, False),
        ({"a": 1}, {"properties": {"a": True}, "additionalProperties": False}, True),
        ({}, {"required": ["a"]}, False),
        (3, {"multipleOf": 3}, False),  # a keyword it does not know: ask jsonschema
        (3, {"$ref": "https://example.org/s"}, False),
        (3, {"x-error": "why", "description": "d", "type": "integer"}, True),
        (1.0, {"type": "integer"}, True),
        (True, {"type": "number"}, False),
        ("ab", {"pattern": "^a", "minLength": 2, "maxLength": 2}, True),
        ("ba", {"pattern": "^a"}, False),
        ([1, "a"], {"items": {"type": "integer"}}, False),
        (2, {"anyOf": [{"type": "string"}, {"minimum": 1}]}, True),
    ],
)
def test_keywords(instance, schema, expected):
    assert surely_valid(instance, schema) is expected
    if expected:
        assert list(Draft202012Validator(schema).iter_errors(instance)) == []
