"""Rank-aware logging: rank 0 prints information once; other ranks print only their
warnings and errors, prefixed with their rank."""

from __future__ import annotations

import logging
import sys

_state = {"debug": False}


class _RankFilter(logging.Filter):
    """Let rank 0 through at any level; other ranks only at WARNING and above."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (pytest and tools swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


def setup_logging(rank: int = 0, world_size: int = 1, debug: bool | None = None) -> None:
    """Configure the ``mdtrain`` logger; safe to call again when the rank becomes known.

    ``debug=None`` keeps the level chosen by an earlier call (the CLI sets ``--debug`` before
    the distributed runtime knows the rank and calls this again).
    """
    if debug is not None:
        _state["debug"] = debug
    logger = logging.getLogger("mdtrain")
    logger.setLevel(logging.DEBUG if _state["debug"] else logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = _StderrHandler()
    prefix = f"[rank {rank}] " if world_size > 1 and rank != 0 else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(message)s"))
    handler.addFilter(_RankFilter(rank))
    logger.addHandler(handler)
