"""Progress reporting: a bar on a terminal, a few plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("mdtrain")


def progress(items: Iterable[T], total: int, desc: str, enabled: bool = True) -> Iterator[T]:
    """Yield ``items``; show a tqdm bar when stderr is a terminal, else log about every 10%."""
    if not enabled:
        yield from items
        return
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, total=total, desc=desc, leave=False, dynamic_ncols=True)
        return
    step = max(total // 10, 1)
    for count, item in enumerate(items, start=1):
        yield item
        if total >= 20 and (count % step == 0 or count == total):
            log.info("%s: %d/%d", desc, count, total)
