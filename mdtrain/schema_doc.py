"""Render the input schema as Markdown: ``python -m mdtrain.schema_doc > docs/input-reference.md``.

The reference is generated, never written by hand, so it cannot drift from the schema that
validates input.json (a test compares the file with a fresh rendering).
"""

from __future__ import annotations

import json
from typing import Any

from mdtrain.schema import load_schema, resolve, schema_types

_HEADER = """\
# Input reference

<!-- Generated from input_schemas/input.schema.json by
     `python -m mdtrain.schema_doc > docs/input-reference.md`; do not edit by hand. -->

"""

_BOUND_SIGNS = {"minimum": "≥", "exclusiveMinimum": ">", "maximum": "≤", "exclusiveMaximum": "<"}


def render_reference(schema: dict | None = None) -> str:
    """Markdown: one section per object of the schema, each a table of its keys."""
    root = load_schema() if schema is None else schema
    sections = []
    for path, node in _objects(root, root, ""):
        sections.append(_section(path, node, root))
    return _HEADER + "\n".join(sections)


def _objects(node: dict, root: dict, path: str) -> list[tuple[str, dict]]:
    """Every object schema with properties, depth first in schema order, with its JSON path."""
    node = resolve(node, root)
    found = [(path, node)] if "properties" in node else []
    for name, sub in node.get("properties", {}).items():
        found += _objects(sub, root, f"{path}.{name}" if path else name)
    key = node.get("x-discriminator")
    for branch in node.get("anyOf", []) if key else []:
        found += _objects(branch, root, _branch_path(path, branch, key, root))
    return found


def _branch_path(path: str, branch: dict, key: str, root: dict) -> str:
    """``model.descriptor (type se_e2_a)``: the title of one branch of a discriminated union
    (the plain path for a branch marked ``x-plain-title``: the standard model)."""
    node = resolve(branch, root)
    if node.get("x-plain-title"):
        return path
    return f"{path} ({key} {node['properties'][key]['enum'][0]})"


def _anchor(title: str) -> str:
    """The Markdown heading anchor of ``## `title` ``."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def _section(path: str, node: dict, root: dict) -> str:
    title = f"`{path}`" if path else "Top level"
    lines = [f"## {title}", "", _cell(node.get("description", "")), ""]
    lines += ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    required = set(node.get("required", []))
    for name, sub in node["properties"].items():
        sub = resolve(sub, root)
        if name in required:
            default = "*required*"
        elif "default" in sub:
            default = f"`{json.dumps(sub['default'], ensure_ascii=False)}`"
        else:
            default = "—"
        text = sub.get("description", "")
        if sub.get("x-aliases"):
            text += " Aliases: " + ", ".join(f"`{a}`" for a in sub["x-aliases"]) + "."
        if sub.get("x-value-aliases"):
            pairs = sub["x-value-aliases"].items()
            text += " Accepted aliases: " + ", ".join(f"`{a}` for `{v}`" for a, v in pairs) + "."
        child = f"{path}.{name}" if path else name
        if "properties" in sub:
            text += f" See [`{child}`](#{child.replace('.', '')})."
        if sub.get("x-discriminator"):
            links = [_branch_path(child, b, sub["x-discriminator"], root) for b in sub["anyOf"]]
            text += " One of " + ", ".join(f"[`{p}`](#{_anchor(p)})" for p in links) + "."
        lines.append(f"| `{name}` | {_cell(_type_text(sub, root))} | {default} | {_cell(text)} |")
    off = node.get("x-off-defaults")
    if off:
        listed = ", ".join(f"`{k}` (`{json.dumps(v)}`)" for k, v in off.items())
        lines += ["", f"Not implemented; accepted only at this value and then ignored: {listed}."]
    for key, why in node.get("x-ignored", {}).items():
        lines += ["", f"`{key}` is accepted and ignored: {_cell(why)}."]
    return "\n".join(lines) + "\n"


def _type_text(node: dict, root: dict) -> str:
    """A short human description of the values a schema node accepts."""
    node = resolve(node, root)
    branches = node.get("anyOf", []) + node.get("oneOf", [])
    if branches:
        return " or ".join(_type_text(b, root) for b in branches)
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    if "enum" in node:
        return " or ".join(f"`{json.dumps(v)}`" if v is not None else "null" for v in node["enum"])
    return " or ".join(_one_type(t, node, root) for t in _ordered(schema_types(node))) or "any"


def _ordered(types: set[str]) -> list[str]:
    order = ["object", "array", "string", "integer", "number", "boolean", "null"]
    return [t for t in order if t in types]


def _one_type(kind: str, node: dict, root: dict) -> str:
    if kind in ("integer", "number"):
        bounds = [f"{_BOUND_SIGNS[k]} {node[k]}" for k in _BOUND_SIGNS if k in node]
        return f"{kind} {', '.join(bounds)}".strip()
    if kind == "array":
        items = node.get("items")
        item = _type_text(items, root) if isinstance(items, dict) else "any"
        size = node.get("minItems")
        if size is not None and size == node.get("maxItems"):
            return f"[{size} × {item}]"
        return f"list of {item}"
    if kind == "string":
        return node.get("x-expected", "string").replace("<", "&lt;").replace(">", "&gt;")
    return kind


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def main() -> None:
    print(render_reference(), end="")


if __name__ == "__main__":
    main()
