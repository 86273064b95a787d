"""The model's ``sel`` (neighbours kept per type): DeePMD's ``auto`` rule and the forms the
input may take (``"auto"``, ``"auto:RATIO"``, a list, one integer).

A descriptor with one type-mixed neighbour list (``mixed``: see
``mdtrain.config.mixed_types``) keeps one ``sel`` for all types: ``"auto"`` applies the rule
to the largest count of neighbours of all types together (DeePMD's ``update_sel`` with
``mixed_type``), a list stands for its sum (DeePMD's documentation: only the sum matters).

Apart from the statistics because the train command and ``mdtrain neighbor-stat`` both turn
an input's ``sel`` into lists, and the stat file records the ``auto`` result.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from mdtrain.errors import MDTrainError

log = logging.getLogger("mdtrain.neighbors")

DEFAULT_SEL_RATIO = 1.1


def auto_sel(max_nbor_size: Sequence[int], ratio: float = DEFAULT_SEL_RATIO) -> list[int]:
    """DeePMD's rule: scale by ``ratio``, truncate, round up to a multiple of 4 (46 → 52)."""
    return [4 * ((int(n * ratio) + 3) // 4) for n in max_nbor_size]


def parse_sel(sel_value: Any) -> float | int | list[int]:
    """``"auto"`` → 1.1, ``"auto:1.2"`` → 1.2 (the ratio, a float); a list → list of ints;
    an integer (a mixed-types descriptor's) → itself."""
    if isinstance(sel_value, str):
        text = sel_value.strip()
        if text == "auto":
            return DEFAULT_SEL_RATIO
        if text.startswith("auto:"):
            try:
                ratio = float(text[5:])
            except ValueError:
                ratio = float("nan")
            if not math.isfinite(ratio) or ratio <= 0:
                raise MDTrainError(
                    f'sel "{sel_value}": the ratio after "auto:" must be a positive number'
                )
            return ratio
        raise MDTrainError(f'sel "{sel_value}": expected "auto", "auto:RATIO" or a list')
    if isinstance(sel_value, int) and not isinstance(sel_value, bool) and sel_value >= 1:
        return int(sel_value)
    if isinstance(sel_value, (list, tuple)) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sel_value
    ):
        return [int(n) for n in sel_value]
    raise MDTrainError(
        f'sel {sel_value!r}: expected a list of non-negative integers, or "auto"/"auto:RATIO"'
    )


def resolve_sel(
    sel_value: Any, max_nbor_size: Sequence[int], mixed: bool = False
) -> list[int] | int:
    """The model's sel: auto forms from the statistics; a list kept, with a warning per type
    whose largest count exceeds it (a zero entry is skipped, as in DeePMD). ``mixed``: one
    integer, and ``max_nbor_size`` is ``[the largest count of all types together]``."""
    parsed = parse_sel(sel_value)
    if mixed:
        return _resolve_mixed(parsed, int(max_nbor_size[0]))
    if isinstance(parsed, int):
        raise MDTrainError(
            f"sel {parsed}: one integer for all types is taken only by descriptors with one "
            "type-mixed neighbour list (se_atten, dpa1, se_atten_v2, se_e3_tebd)"
        )
    if isinstance(parsed, float):
        return auto_sel(max_nbor_size, parsed)
    if len(parsed) != len(max_nbor_size):
        raise MDTrainError(
            f"sel {parsed}: {len(parsed)} entries but the type_map has {len(max_nbor_size)} types"
        )
    for t, (given, needed) in enumerate(zip(parsed, max_nbor_size, strict=True)):
        if given and needed > given:
            log.warning(
                "sel[%d] = %d is smaller than the largest neighbour count %d of type %d in "
                "the data: neighbours beyond it are dropped (\"auto\" would give %d)",
                t, given, needed, t, auto_sel([needed])[0],
            )  # fmt: skip
    return parsed


def _resolve_mixed(parsed: float | int | list[int], total: int) -> int:
    """One sel for all types together, from the largest total count ``total``."""
    if isinstance(parsed, float):
        return auto_sel([total], parsed)[0]
    given = sum(parsed) if isinstance(parsed, list) else parsed
    if total > given:
        log.warning(
            "sel = %d is smaller than the largest neighbour count %d (all types together) in "
            'the data: neighbours beyond it are dropped ("auto" would give %d)',
            given, total, auto_sel([total])[0],
        )  # fmt: skip
    return given
