"""The generated input reference covers every key and is up to date with the schema."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from mdtrain.schema import load_schema, resolve
from mdtrain.schema_doc import render_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "input-reference.md"


def _keys(node, root, path=""):
    node = resolve(node, root)
    for name, sub in node.get("properties", {}).items():
        child = f"{path}.{name}" if path else name
        yield path, name, resolve(sub, root)
        yield from _keys(sub, root, child)
    key = node.get("x-discriminator")
    for branch in node.get("anyOf", []) if key else []:
        value = resolve(branch, root)["properties"][key]["enum"][0]
        plain = resolve(branch, root).get("x-plain-title")  # the standard model: `model`
        yield from _keys(branch, root, path if plain else f"{path} ({key} {value})")


def test_reference_is_regenerated():
    assert DOC.read_text(encoding="utf-8") == render_reference(load_schema()), (
        "docs/input-reference.md is stale: run `python -m mdtrain.schema_doc > "
        "docs/input-reference.md`"
    )


def test_every_key_has_a_row_in_its_section():
    schema = load_schema()
    text = render_reference(schema)
    sections = {}
    for block in text.split("\n## ")[1:]:
        title, _, body = block.partition("\n")
        sections[title.strip("`")] = body
    count = 0
    for path, name, sub in _keys(schema, schema):
        section = sections[path or "Top level"]
        row = next((r for r in section.splitlines() if r.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{path}.{name} missing"
        assert sub["description"].split("`")[0][:20].replace("|", "\\|") in row
        for alias in sub.get("x-aliases", []):
            assert f"`{alias}`" in row
        count += 1
    assert count > 60


def test_rows_show_type_default_and_required():
    text = render_reference(load_schema())
    assert "| `rcut` | number > 0 | `6.0` |" in text
    assert re.search(r"\| `descriptor` \| object( or object)* \| \*required\* \|", text)
    assert "| `type_map` | list of string | — |" in text  # optional, as in DeePMD-kit
    assert "| `decay_rate` | number > 0, ≤ 1 or null | `null` |" in text
    assert '| `backend` | `"auto"` or `"nccl"` or `"gloo"` or `"mpi"` | `"auto"` |' in text
    assert "(#modeldescriptor-type-se_e2_a)" in text
    assert "## `model.descriptor (type se_e2_a)`" in text


def test_module_prints_the_reference():
    result = subprocess.run(
        [sys.executable, "-m", "mdtrain.schema_doc"], capture_output=True, text=True, check=True
    )
    assert result.stdout == render_reference(load_schema())
