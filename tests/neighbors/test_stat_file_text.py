"""``neighbor_stat.json``'s text from the template (stat_file.indented_json) is json's own
``json.dumps(content, indent=2)``, character for character, whatever the entries hold."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from mdtrain.neighbors.stat_file import indented_json

PATHS = ["/data/sys.000", 'a "quoted" \\ path', "données/système", "tab\there", "\u2603/\U0001f600"]


def _entry(rng: random.Random, ntypes: int) -> dict:
    return {
        "path": rng.choice(PATHS) + str(rng.randrange(10)),
        "nframes": rng.randrange(1, 10**6),
        "natoms": rng.randrange(1, 5000),
        "sha256": f"{rng.getrandbits(256):064x}",
        "min_nbor_dist": rng.choice(
            [None, 0.1, 1.0, 2.300959047990587, 1e-7, 123456.789, rng.uniform(0.5, 5.0)]
        ),
        "max_nbor_size": [rng.randrange(0, 200) for _ in range(ntypes)],
        "max_nbor_total": rng.randrange(0, 500),
    }


def _content(systems: list) -> dict:
    return {"rcut": 5.0, "type_map": ["Al", "Cu"], "min_nbor_dist": 2.3, "max_nbor_size": [1, 2],
            "sel": [2, 3], "max_nbor_total": 3, "sel_total": 4, "sel_ratio": 1.1,
            "systems": systems, "fingerprint": "ab", "mdtrain_version": "0.1.0"}  # fmt: skip


@pytest.mark.parametrize("seed", range(5))
def test_same_text_as_json(seed):
    rng = random.Random(seed)
    ntypes = rng.choice([0, 1, 3])
    content = _content([_entry(rng, ntypes) for _ in range(rng.randrange(1, 30))])
    assert indented_json(content) == json.dumps(content, indent=2)


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e.update(min_nbor_dist=math.inf),
        lambda e: e.update(min_nbor_dist=math.nan),
        lambda e: e.update(natoms=np.int64(3)),
        lambda e: e.update(max_nbor_size=[True, 2]),
        lambda e: e.update(extra=1),
        lambda e: e.pop("sha256"),
        lambda e: e.update(path=None),
    ],
)
def test_unusual_entries_as_json_writes_them(change):
    entries = [_entry(random.Random(1), 2), _entry(random.Random(2), 2)]
    change(entries[1])
    content = _content(entries)
    try:
        expected = json.dumps(content, indent=2)
    except TypeError:  # numpy's integers: json refuses them, so does the file's writer
        with pytest.raises(TypeError):
            indented_json(content)
        return
    assert indented_json(content) == expected


def test_no_systems_and_systems_last():
    assert indented_json(_content([])) == json.dumps(_content([]), indent=2)
    content = {"a": 1, "systems": [_entry(random.Random(3), 1)]}
    assert indented_json(content) == json.dumps(content, indent=2)
