"""The ``neighbor_stat.json`` file: write it atomically, read it back, and check that it was
computed with this rcut, type_map and data.

Apart from the computation (``stat``) because the train command only reads and checks a file
that ``mdtrain neighbor-stat`` wrote earlier.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from typing import Any

from mdtrain import __version__
from mdtrain.errors import MDTrainError
from mdtrain.neighbors.fingerprint import content_hash, data_fingerprint
from mdtrain.neighbors.sel import DEFAULT_SEL_RATIO, auto_sel
from mdtrain.neighbors.stat_result import NeighborStat


def neighbor_stat_to_dict(
    stat: NeighborStat, type_map: Sequence[str], sel_ratio: float = DEFAULT_SEL_RATIO
) -> dict[str, Any]:
    """The contents of ``neighbor_stat.json``."""
    min_dist = stat.min_nbor_dist if math.isfinite(stat.min_nbor_dist) else None
    return {
        "rcut": stat.rcut,
        "type_map": list(type_map),
        "min_nbor_dist": min_dist,
        "max_nbor_size": list(stat.max_nbor_size),
        "sel": auto_sel(stat.max_nbor_size, sel_ratio),
        "max_nbor_total": stat.max_nbor_total,  # all types together (mixed-types descriptors)
        "sel_total": auto_sel([stat.max_nbor_total], sel_ratio)[0],
        "sel_ratio": sel_ratio,
        "systems": [
            {
                "path": s.path,
                "nframes": s.nframes,
                "natoms": s.natoms,
                "sha256": s.sha256,
                "min_nbor_dist": s.min_nbor_dist if math.isfinite(s.min_nbor_dist) else None,
                "max_nbor_size": s.max_nbor_size,
                "max_nbor_total": s.max_nbor_total,
            }
            for s in stat.systems
        ],
        "fingerprint": stat.fingerprint,
        "mdtrain_version": __version__,
    }


def write_neighbor_stat(
    path: str,
    stat: NeighborStat,
    type_map: Sequence[str],
    sel_ratio: float = DEFAULT_SEL_RATIO,
) -> dict[str, Any]:
    """Write the JSON file atomically (a temporary file renamed over ``path``); return it."""
    content = neighbor_stat_to_dict(stat, type_map, sel_ratio)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".neighbor_stat.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(indented_json(content))
                handle.write("\n")
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise MDTrainError(f"{path}: cannot write the neighbour statistics ({exc})") from None
    return content


_ENTRY_KEYS = ("path", "nframes", "natoms", "sha256", "min_nbor_dist", "max_nbor_size",
               "max_nbor_total")  # fmt: skip


def indented_json(content: dict[str, Any]) -> str:
    """``json.dumps(content, indent=2)``, character for character, with the per-system
    entries written from a template: json's indented output is its pure-Python encoder,
    a few hundredths of a second for thousands of systems. Anything the template does not
    cover exactly goes to json."""
    systems = content.get("systems")
    entries = [_entry_text(e) for e in systems] if isinstance(systems, list) and systems else None
    if entries is None or None in entries:
        return json.dumps(content, indent=2)
    keys = list(content)
    at = keys.index("systems")
    before = json.dumps({k: content[k] for k in keys[:at]}, indent=2)
    after = json.dumps({k: content[k] for k in keys[at + 1 :]}, indent=2)
    head = before[:-2] + ",\n" if at else "{\n"
    tail = ",\n" + after[2:] if at + 1 < len(keys) else "\n}"
    return head + '  "systems": [\n' + ",\n".join(entries) + "\n  ]" + tail


def _entry_text(entry: Any) -> str | None:
    """One system's entry as json indents it at depth 2 (None: not of the usual form)."""
    if not isinstance(entry, dict) or tuple(entry) != _ENTRY_KEYS:
        return None
    ints = [entry[k] for k in ("nframes", "natoms", "max_nbor_total")] + entry["max_nbor_size"]
    dist = entry["min_nbor_dist"]
    if (
        any(type(v) is not int for v in ints)
        or type(entry["path"]) is not str
        or type(entry["sha256"]) is not str
        or not (dist is None or (type(dist) is float and math.isfinite(dist)))
    ):
        return None
    sizes = entry["max_nbor_size"]
    listed = "[\n        " + ",\n        ".join(map(str, sizes)) + "\n      ]" if sizes else "[]"
    return (
        f'    {{\n      "path": {_string(entry["path"])},\n'
        f'      "nframes": {entry["nframes"]},\n      "natoms": {entry["natoms"]},\n'
        f'      "sha256": {_string(entry["sha256"])},\n'
        f'      "min_nbor_dist": {"null" if dist is None else float.__repr__(dist)},\n'
        f'      "max_nbor_size": {listed},\n'
        f'      "max_nbor_total": {entry["max_nbor_total"]}\n    }}'
    )


_string = json.encoder.encode_basestring_ascii  # json's own (ensure_ascii, its default)

_REQUIRED_KEYS = ("rcut", "type_map", "min_nbor_dist", "max_nbor_size", "sel", "fingerprint")


def load_neighbor_stat(path: str) -> dict[str, Any]:
    """Read a file written by ``mdtrain neighbor-stat``; errors name the file and the key."""
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except FileNotFoundError:
        raise MDTrainError(f"{path}: neighbour-stat file not found") from None
    except json.JSONDecodeError as exc:
        raise MDTrainError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MDTrainError(f"{path}: cannot read ({exc})") from None
    if not isinstance(content, dict):
        raise MDTrainError(f"{path}: expected a JSON object written by mdtrain neighbor-stat")
    for key in _REQUIRED_KEYS:
        if key not in content:
            raise MDTrainError(f"{path}: key '{key}' missing; rerun mdtrain neighbor-stat")
    _check_consistent(path, content)
    return content


def _check_consistent(path: str, content: dict[str, Any]) -> None:
    """The file's totals are those of its own per-system entries (an edited count is
    refused, not trusted)."""
    hint = "the file was edited or damaged; rerun mdtrain neighbor-stat"
    top = content["max_nbor_size"]
    if not isinstance(top, list) or not all(isinstance(n, int) and n >= 0 for n in top):
        raise MDTrainError(f"{path}: max_nbor_size {top!r} is not a list of counts; {hint}")
    entries = content.get("systems") or []
    sizes = [e.get("max_nbor_size") for e in entries if isinstance(e, dict)]
    if not sizes:
        return
    if any(not isinstance(n, list) or len(n) != len(top) for n in sizes):
        raise MDTrainError(f"{path}: a system's max_nbor_size has not {len(top)} entries; {hint}")
    largest = [max(int(n[t]) for n in sizes) for t in range(len(top))]
    if largest != list(top):
        raise MDTrainError(
            f"{path}: max_nbor_size {top} disagrees with its systems' largest counts "
            f"{largest}; {hint}"
        )
    dists = [e.get("min_nbor_dist") for e in entries if e.get("min_nbor_dist") is not None]
    stored = content["min_nbor_dist"]
    if dists and (stored is None or not math.isclose(float(stored), min(dists), rel_tol=1e-12)):
        raise MDTrainError(
            f"{path}: min_nbor_dist {stored} disagrees with its systems' smallest "
            f"{min(dists)}; {hint}"
        )


def check_neighbor_stat_matches(
    stat: dict[str, Any],
    rcut: float,
    type_map: Sequence[str],
    systems: Sequence,
    *,
    source: str = "neighbour-stat file",
) -> None:
    """Raise MDTrainError unless ``stat`` was computed with this rcut, type_map and data.

    ``systems`` are ``mdtrain.data.System`` objects; data are compared by content hash, so
    a data set that only moved still matches.
    """
    hint = "rerun mdtrain neighbor-stat"
    if not math.isclose(float(stat["rcut"]), float(rcut), rel_tol=1e-12, abs_tol=1e-12):
        raise MDTrainError(f"{source}: computed for rcut = {stat['rcut']}, not {rcut}; {hint}")
    if list(stat["type_map"]) != list(type_map):
        raise MDTrainError(
            f"{source}: computed for type_map {list(stat['type_map'])}, not {list(type_map)}; "
            f"{hint}"
        )
    current = [(content_hash(system.fingerprint()), system.path) for system in systems]
    if data_fingerprint([sha for sha, _ in current]) == stat["fingerprint"]:
        return
    stored = [(entry.get("sha256"), entry.get("path")) for entry in stat.get("systems", [])]
    # pair systems up: same data at the same path first, then same data anywhere (moved)
    exact = Counter(stored) & Counter(current)
    left_stored = list((Counter(stored) - exact).elements())
    left_current = list((Counter(current) - exact).elements())
    by_hash = Counter(sha for sha, _ in left_stored) & Counter(sha for sha, _ in left_current)
    stored_paths = {path for _, path in stored}
    unmatched = Counter(by_hash)
    for sha, path in left_current:
        if unmatched[sha] > 0:
            unmatched[sha] -= 1
            continue
        was = " (its data changed)" if path in stored_paths else ""
        raise MDTrainError(
            f"{source}: system {path} is not among the data it was computed on{was}; {hint}"
        )
    unmatched = Counter(by_hash)
    for sha, path in left_stored:
        if unmatched[sha] > 0:
            unmatched[sha] -= 1
            continue
        raise MDTrainError(
            f"{source}: computed on system {path}, which is not in the data now; {hint}"
        )
    raise MDTrainError(f"{source}: data fingerprint differs; {hint}")
