"""Rank-aware logging: rank 0 prints information once; other ranks print only their
warnings and errors, prefixed with their rank."""

from __future__ import annotations

import logging
import sys


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(rank: int = 0, world_size: int = 1, debug: bool = False) -> None:
    """Configure the ``mdtrain`` logger; safe to call again when the rank becomes known."""
    logger = logging.getLogger("mdtrain")
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[rank {rank}] " if world_size > 1 and rank != 0 else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(message)s"))
    handler.addFilter(_RankFilter(rank))
    logger.addHandler(handler)
