"""Ranks of a benchmark on this machine: what torchrun would give each child process, with
the rendezvous on loopback (shared by the multi-rank benchmarks)."""

from __future__ import annotations

import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, for children


def free_port() -> int:
    """A TCP port free on loopback now (for MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world: int, port: str) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world`` single-threaded ranks on this node, which
    import mdtrain from this checkout."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    }
