"""Slurm's compact notations: host lists (``a[01-03],b1``) and tasks per node (``2(x3),1``).

A parser of its own, apart from the launcher detection that uses it, because the notation has
its own rules (nested ranges, zero padding) and its own tests.
"""

from __future__ import annotations

import re

from mdtrain.errors import MDTrainError


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm compact host list: ``"a[01-03,07],b1"`` → a01 a02 a03 a07 b1.

    Zero padding follows the lower bound of each range; several bracket groups in one name
    (``r[1-2]n[1-2]``) expand as a product, like Slurm does.
    """
    hosts: list[str] = []
    for name in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_name(name))
    return hosts


def first_host(hostlist: str) -> str:
    """The first host of a compact host list (where rank 0 runs for a Slurm step)."""
    names = _split_top_level(hostlist.strip())
    if not names:
        raise MDTrainError(f"empty Slurm node list {hostlist!r}")
    return _expand_name(names[0])[0]


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if depth < 0 or depth > 1:
            raise MDTrainError(f"cannot parse Slurm node list {text!r}: unbalanced brackets")
    if depth != 0:
        raise MDTrainError(f"cannot parse Slurm node list {text!r}: unbalanced brackets")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_name(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    values: list[str] = []
    for item in match.group(1).split(","):
        item = item.strip()
        if re.fullmatch(r"\d+", item):
            values.append(item)
        elif (m := re.fullmatch(r"(\d+)-(\d+)", item)) is not None:
            lo, hi = m.group(1), m.group(2)
            if int(hi) < int(lo):
                raise MDTrainError(f"cannot parse Slurm node list {name!r}: range {item!r}")
            values.extend(str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1))
        else:
            raise MDTrainError(f"cannot parse Slurm node list {name!r}: item {item!r}")
    return [head + v + rest for v in values for rest in _expand_name(tail)]


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` form: ``"2(x3),1"`` → [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise MDTrainError(f"cannot parse Slurm tasks per node {value!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
