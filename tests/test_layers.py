"""Imports flow one way: every import in ``mdtrain/`` (those inside functions included) goes to
the same package or to a lower layer, in the order stated in ``docs/developer.md``. And the
tests keep to their own rule: a module under ``tests/`` imports from ``tests.helpers`` (and
uses conftest fixtures), never from a test module, and changes no global state when imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mdtrain"

# Lowest first. A module belongs to the longest prefix listed; it may import its own unit
# (the prefix it belongs to) and any unit of a lower layer, never one of the same layer.
LAYERS: list[list[str]] = [
    ["mdtrain.errors"],
    ["mdtrain.log"],
    ["mdtrain.outputs"],  # where outputs go, checked before any work
    ["mdtrain.progress"],
    ["mdtrain.schema"],
    ["mdtrain.config", "mdtrain.schema_doc"],
    ["mdtrain.heap", "mdtrain.cache_dir"],  # process set-up without torch
    ["mdtrain.memory"],
    ["mdtrain.data"],
    ["mdtrain.neighbors"],
    ["mdtrain.batching"],
    ["mdtrain.model"],  # the reference model, its statistics and model files
    ["mdtrain.model.accel"],  # fast paths: fused nodes, compiled kernels
    ["mdtrain.model.backend"],  # the one choice between them
    ["mdtrain.distributed"],
    ["mdtrain.train", "mdtrain.infer", "mdtrain.plot"],
    ["mdtrain.check", "mdtrain.calculator"],  # calculator: the short import of infer's
    ["mdtrain.commands"],
    ["mdtrain.cli"],
    ["mdtrain.__main__"],
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
TOP = "mdtrain"  # the package itself (its __init__ holds the version only)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str | None:
    """The longest listed prefix of ``module`` (None: not placed in any layer)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in RANK:
            return prefix
    return None


def imports_of(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the file."""
    found = []
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


FILES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_imports_go_to_the_same_unit_or_a_lower_layer(path):
    source = module_name(path)
    if source == TOP:
        return
    unit = unit_of(source)
    assert unit is not None, f"{source} is in no layer: add it to LAYERS and docs/developer.md"
    problems = []
    for target, names, line in imports_of(path):
        if target == TOP:  # `from mdtrain import __version__` or a subpackage by name
            target = f"{TOP}.{names[0]}" if names and names[0] != "__version__" else TOP
        if not target.startswith(f"{TOP}.") or target == TOP:
            continue
        candidates = [target] + [f"{target}.{n}" for n in names]
        to = next((u for u in map(unit_of, reversed(candidates)) if u is not None), None)
        if to is None:
            problems.append(f"line {line}: {target} is in no layer")
        elif to != unit and RANK[to] >= RANK[unit]:
            problems.append(f"line {line}: imports {target} ({to}, not below {unit})")
    assert not problems, f"{source}: " + "; ".join(problems)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_private_names_from_other_modules(path):
    """A module's underscore names are its own: another module that needs one gets a public
    name instead (relative imports inside one module's own tests aside)."""
    private = [
        f"line {line}: {name} from {target}"
        for target, names, line in imports_of(path)
        if target.startswith(f"{TOP}.")
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private, f"{module_name(path)}: " + "; ".join(private)


MAX_LINES = 400  # small modules with one job


def test_no_module_is_over_400_lines():
    long = {module_name(p): n for p in FILES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines, split by job: {long}"


def test_every_layer_unit_exists():
    modules = {module_name(p) for p in FILES}
    missing = [u for u in RANK if not any(m == u or m.startswith(u + ".") for m in modules)]
    assert not missing, f"listed but absent: {missing}"


# ------------------------------------------------------------------------------------ tests/

TESTS = ROOT.parent / "tests"
TEST_TREE_FILES = sorted(TESTS.rglob("*.py"))
# calls that change the process for every test after them when made at import time
GLOBAL_SETTINGS = {"set_num_threads", "set_num_interop_threads"}


def is_test_module(module: str) -> bool:
    return module.split(".")[0] == "tests" and module.rpartition(".")[2].startswith("test_")


def import_time_calls(tree: ast.Module) -> Iterator[ast.Call]:
    """Every call that runs when the module is imported: function bodies aside (their
    decorators and default values do run), class bodies and module-level blocks included."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            todo += [*node.decorator_list, *node.args.defaults]
            todo += [d for d in node.args.kw_defaults if d is not None]
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Call):
            yield node
        todo += list(ast.iter_child_nodes(node))


def test_tests_import_only_helpers_and_set_nothing_at_import():
    """No module under tests/ imports a test module (``tests.…test_*``): shared code lives in
    ``tests/helpers/``. None calls ``torch.set_num_threads`` at import time: such settings
    belong to ``tests/conftest.py`` (``pytest_configure`` or a fixture)."""
    assert TEST_TREE_FILES and any(p.parent == TESTS / "helpers" for p in TEST_TREE_FILES)
    problems = []
    for path in TEST_TREE_FILES:
        where = path.relative_to(ROOT.parent)
        for target, names, line in imports_of(path):
            for module in [target] + [f"{target}.{n}" for n in names]:
                if is_test_module(module):
                    problems.append(f"{where}:{line}: imports the test module {module}")
        calls = import_time_calls(ast.parse(path.read_text(), str(path)))
        for call in sorted(calls, key=lambda c: c.lineno):
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in GLOBAL_SETTINGS:
                problems.append(f"{where}:{call.lineno}: {name} at import time")
    assert not problems, "\n".join(problems)
