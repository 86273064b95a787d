"""The user documentation agrees with the code: commands and options parse with the real CLI,
input keys exist in the schema, links resolve, environment variables are ones mdtrain reads,
and Python snippets import what exists.

Checked files: docs/*.md and the top-level README.md. Only inline code spans and fenced code
blocks are read, so prose may say anything.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
import shlex
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from mdtrain.cli import build_parser
from mdtrain.schema import load_schema, resolve

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOC_FILES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]
SECTIONS = ("model", "learning_rate", "loss", "training")

# Variables the docs tell users to set or read that mdtrain itself never reads.
# MDTRAIN_DEEPMD_*: the interop tests; OMP_PROC_BIND, OMP_PLACES: OpenMP's thread binding,
# named in performance.md as a measured variant
EXTERNAL_ENV = {
    "SLURM_CPUS_PER_TASK",
    "MDTRAIN_DEEPMD_PYTHON",
    "MDTRAIN_DEEPMD_PT_PYTHON",
    "OMP_PROC_BIND",
    "OMP_PLACES",
}

_FENCE = re.compile(r"^[ \t]*```([\w/+-]*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_ENV = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]\b")
_SHELL_LANGS = {"", "bash", "sh", "shell", "console"}


# ---------------------------------------------------------------------------------- reading


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _blocks(text: str) -> list[tuple[str, str]]:
    """Fenced code blocks as (language, body)."""
    return [(m.group(1).lower(), textwrap.dedent(m.group(2))) for m in _FENCE.finditer(text)]


def _prose(text: str) -> str:
    return _FENCE.sub("", text)


def _spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    return [s.strip() for s in _INLINE.findall(_prose(text))]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _shell_lines(body: str) -> Iterator[str]:
    """Logical lines of a shell block: continuations joined, comments dropped."""
    pending = ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            yield line
    if pending.strip():
        yield pending


def _mdtrain_args(line: str) -> list[str] | None:
    """The arguments after the program ``mdtrain`` (also ``python -m mdtrain``, ``torchrun ...
    -m mdtrain``) in a command line, up to the first shell operator; None when the line does
    not run mdtrain. Options of other programs are single tokens (``--job-name=mdtrain``)."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return None
    if "mdtrain" not in tokens:
        return None
    args = []
    for arg in tokens[tokens.index("mdtrain") + 1 :]:
        if arg in {"|", "||", "&&", ";", "&"} or arg.startswith((">", "2>")):
            break
        args.append(arg)
    return args


def _command_lines() -> list[tuple[str, list[str], bool]]:
    """(where, arguments, complete) for every mdtrain command shown; ``complete`` is False for
    an inline mention of a bare command name (``mdtrain check``), which is checked by name."""
    found = []
    for path in DOC_FILES:
        text = _read(path)
        for lang, body in _blocks(text):
            if lang not in _SHELL_LANGS:
                continue
            for line in _shell_lines(body):
                args = _mdtrain_args(line)
                if args is not None:
                    found.append((f"{_id(path)}: {line.strip()}", args, True))
        for span in _spans(text):
            if re.match(r"^(python -m |torchrun .*-m |srun .*|)mdtrain(\s|$)", span):
                args = _mdtrain_args(span)
                if args is not None:
                    named = [a for a in args if not a.startswith("-")]
                    found.append((f"{_id(path)}: `{span}`", args, len(named) > 1))
    return found


# ---------------------------------------------------------------------------------- the CLI


def _subparsers(
    parser: argparse.ArgumentParser | None = None,
) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers of mdtrain's CLI, by command name."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("mdtrain's parser has no subcommands")


class _ParseError(Exception):
    pass


def _parse(args: list[str]) -> argparse.Namespace:
    """Parse with the real parser; errors raise instead of exiting."""
    parser = build_parser()

    def fail(message: str) -> None:
        raise _ParseError(message)

    for p in [parser, *_subparsers(parser).values()]:
        p.error = fail  # type: ignore[method-assign]
    return parser.parse_args(args)


COMMANDS = _command_lines()


def test_docs_show_mdtrain_commands() -> None:
    assert len(COMMANDS) > 20, "the command extraction found almost nothing: regex broken?"


@pytest.mark.parametrize("where,args,complete", COMMANDS, ids=[c[0][:90] for c in COMMANDS])
def test_every_command_shown_parses(where: str, args: list[str], complete: bool) -> None:
    commands = _subparsers()
    names = [a for a in args if not a.startswith("-")]
    if not names or names[0].isupper():  # `mdtrain --version`, `mdtrain COMMAND --help`
        return
    assert names[0] in commands, f"{where}: no command {names[0]!r} (have {sorted(commands)})"
    if complete:
        try:
            _parse([a for a in args if a not in ("-h", "--help")])
        except _ParseError as exc:
            pytest.fail(f"{where}: mdtrain rejects it: {exc}")


def test_every_command_and_option_is_documented() -> None:
    shown = "\n".join(_read(p) for p in DOC_FILES)
    for name, sub in _subparsers().items():
        assert f"mdtrain {name}" in shown, f"`mdtrain {name}` is not documented"
        for action in sub._actions:
            options = [o for o in action.option_strings if o not in ("-h", "--help")]
            if options:
                tokens = (re.compile(rf"(?<![\w-]){re.escape(o)}(?![\w-])") for o in options)
                assert any(t.search(shown) for t in tokens), (
                    f"`mdtrain {name} {'/'.join(options)}` is not documented"
                )


def test_a_wrong_option_is_caught() -> None:
    """The checker itself: a misspelt option in a doc line must fail."""
    with pytest.raises(_ParseError):
        _parse(_mdtrain_args("torchrun --nproc_per_node=2 -m mdtrain train in.json --restrat auto"))
    assert _mdtrain_args("srun python -m mdtrain train in.json > log") == ["train", "in.json"]


# ---------------------------------------------------------------------------------- input keys


def _known_keys(node: dict, root: dict) -> dict[str, dict]:
    """Keys accepted at an object node (properties, aliases, off-default and ignored options),
    each with its sub-schema ({} when it has none to descend into)."""
    node = resolve(node, root)
    keys: dict[str, dict] = {}
    branches = [node] + [resolve(b, root) for b in node.get("anyOf", []) + node.get("oneOf", [])]
    for branch in branches:
        for name, sub in branch.get("properties", {}).items():
            keys[name] = sub
            for alias in resolve(sub, root).get("x-aliases", []):
                keys[alias] = sub
        for name in list(branch.get("x-off-defaults", {})) + list(branch.get("x-ignored", {})):
            keys.setdefault(name, {})
    return keys


def _key_path_problem(path: str) -> str | None:
    root = load_schema()
    node: dict = root
    parts = path.split(".")
    for k, part in enumerate(parts):
        keys = _known_keys(node, root)
        if part not in keys:
            where = ".".join(parts[:k]) or "the top level"
            return f"`{path}`: no key {part!r} at {where}"
        node = keys[part]
    return None


def _key_spans() -> list[tuple[str, str]]:
    pattern = re.compile(rf"^(?:{'|'.join(SECTIONS)})(?:\.[A-Za-z_]+)+$")
    file_name = re.compile(r"^model\.ckpt|\.(pt|pth|dp|pb|json|out|h5|hdf5|png|md|npy|raw)$")
    found = []
    for path in DOC_FILES:
        for span in _spans(_read(path)):
            if pattern.match(span) and not file_name.search(span):
                found.append((_id(path), span))
    return found


@pytest.mark.parametrize("where,key", _key_spans())
def test_input_key_paths_exist(where: str, key: str) -> None:
    problem = _key_path_problem(key)
    assert problem is None, f"{where}: {problem}"


def _schema_objects(node: dict, root: dict, path: str) -> Iterator[tuple[str, dict]]:
    keys = _known_keys(node, root)
    if keys:
        yield path, node
    for name, sub in keys.items():
        if sub:
            yield from _schema_objects(sub, root, f"{path}.{name}" if path else name)


def _unknown_keys(value: dict, node: dict, root: dict, path: str) -> list[str]:
    keys = _known_keys(node, root)
    problems = []
    for name, sub in value.items():
        if name.startswith("_"):
            continue
        where = f"{path}.{name}" if path else name
        if name not in keys:
            problems.append(where)
        elif isinstance(sub, dict) and keys[name]:
            problems += _unknown_keys(sub, keys[name], root, where)
    return problems


def _json_snippets() -> list[tuple[str, str]]:
    return [
        (f"{_id(path)} json block {k}", body.strip())
        for path in DOC_FILES
        for k, (lang, body) in enumerate(_blocks(_read(path)))
        if lang == "json"
    ]


JSON_SNIPPETS = _json_snippets()


@pytest.mark.parametrize("where,text", JSON_SNIPPETS, ids=[w for w, _ in JSON_SNIPPETS])
def test_json_snippets_use_existing_keys(where: str, text: str) -> None:
    """A snippet (an object, or `"key": value` pairs) is valid JSON; it is placed where its top
    keys fit (the top level, `training`, ...), then walked."""
    value = json.loads(text if text.startswith("{") else "{" + text + "}")
    root = load_schema()
    top = {k for k in value if not k.startswith("_")}
    homes = [(p, n) for p, n in _schema_objects(root, root, "") if top <= set(_known_keys(n, root))]
    assert homes, f"{where}: no section of the input accepts all of {sorted(top)}"
    path, node = homes[0]
    unknown = _unknown_keys(value, node, root, path)
    assert not unknown, f"{where}: keys not in the schema: {unknown}"


def test_key_checker_rejects_a_wrong_key() -> None:
    assert _key_path_problem("training.distributed.backend") is None
    assert _key_path_problem("training.stop_batch") is None  # alias
    assert _key_path_problem("training.distributed.backends") is not None


# ---------------------------------------------------------------------------------- links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.*)$", _prose(_read(path)), re.M)
    return {_slug(h) for h in headings}


def _links() -> list[tuple[str, Path, str]]:
    found = []
    for path in DOC_FILES:
        for target in _LINK.findall(_prose(_read(path))):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            found.append((_id(path), path, target))
    return found


LINKS = _links()


@pytest.mark.parametrize("where,source,target", LINKS, ids=[f"{w}->{t}" for w, _, t in LINKS])
def test_links_resolve(where: str, source: Path, target: str) -> None:
    file_part, _, anchor = target.partition("#")
    dest = (source.parent / file_part).resolve() if file_part else source
    assert dest.exists(), f"{where}: link to {target} leads nowhere ({dest})"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{where}: no heading for #{anchor} in {dest.name}"


def test_index_links_every_page() -> None:
    index = _read(DOCS / "README.md")
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"


# ---------------------------------------------------------------------------------- env vars


def _source_text() -> str:
    return "\n".join(_read(p) for p in sorted((ROOT / "mdtrain").rglob("*.py")))


def _read_by_mdtrain(name: str, source: str) -> bool:
    """``name`` appears in the source, or is built there from a prefix literal and a suffix
    literal (``"OMPI_COMM_WORLD_" + "LOCAL_RANK"``)."""
    if name in source:
        return True
    prefixes = set(re.findall(r'"([A-Z][A-Z0-9_]*_)"', source))
    return any(name.startswith(p) and f'"{name[len(p) :]}"' in source for p in prefixes)


def _env_mentions() -> list[tuple[str, str]]:
    """Upper-case names with an underscore in inline code and in shell blocks."""
    found = set()
    for path in DOC_FILES:
        text = _read(path)
        pieces = _spans(text) + [body for lang, body in _blocks(text) if lang in _SHELL_LANGS]
        for piece in pieces:
            found.update((_id(path), name) for name in _ENV.findall(piece))
    return sorted(found)


@pytest.mark.parametrize("where,name", _env_mentions())
def test_env_vars_mentioned_are_read_by_mdtrain(where: str, name: str) -> None:
    if name in EXTERNAL_ENV:
        return
    assert _read_by_mdtrain(name, _source_text()), f"{where}: {name} appears nowhere in mdtrain/"


def test_mdtrain_env_vars_and_launcher_vars_are_documented() -> None:
    """Every MDTRAIN_* variable, and every launcher variable the runtime reads, is named in
    the docs (the launcher ones in distributed.md)."""
    docs = "\n".join(_read(p) for p in DOC_FILES)
    for name in set(re.findall(r"\bMDTRAIN_[A-Z0-9_]+\b", _source_text())):
        assert name in docs, f"{name} is read by mdtrain but not documented"
    modules = sorted((ROOT / "mdtrain" / "distributed").glob("*.py"))
    literals = {
        n.value
        for path in modules
        for n in ast.walk(ast.parse(_read(path)))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    launcher = re.compile(r"^(SLURM|OMPI|PMI|MPI|MV2)_[A-Z0-9_]*[A-Z0-9]$")
    torchrun = {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
    names = sorted(n for n in literals if launcher.match(n) or n in torchrun)
    assert len(names) > 20, "found almost no launcher variables in distributed/: check the filter"
    distributed_md = _read(DOCS / "distributed.md")
    for name in names:
        assert f"`{name}`" in distributed_md, f"distributed.md does not name `{name}`"


# ---------------------------------------------------------------------------------- python


def _python_snippets() -> list[tuple[str, str]]:
    return [
        (f"{_id(path)} python block {k}", body)
        for path in DOC_FILES
        for k, (lang, body) in enumerate(_blocks(_read(path)))
        if lang == "python"
    ]


PYTHON_SNIPPETS = _python_snippets()


@pytest.mark.parametrize("where,code", PYTHON_SNIPPETS, ids=[w for w, _ in PYTHON_SNIPPETS])
def test_python_snippets_import_what_exists(where: str, code: str) -> None:
    tree = ast.parse(code)  # a syntax error fails here
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mdtrain"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mdtrain"):
                    importlib.import_module(alias.name)
