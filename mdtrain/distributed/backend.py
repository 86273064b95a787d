"""The process-group backend: NCCL, Gloo or MPI, from the request (command line, input.json,
or ``auto``) and what this PyTorch build and this device can do, with an optional fallback to
Gloo."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from mdtrain.errors import MDTrainError

log = logging.getLogger("mdtrain.distributed")

BACKENDS = ("auto", "nccl", "gloo", "mpi")


def resolve_backend_request(cli_value: str | None, config_value: str | None) -> str:
    """The command line wins over input.json; neither given means "auto"."""
    value = cli_value or config_value or "auto"
    value = value.strip().lower()
    if value not in BACKENDS:
        raise MDTrainError(f"backend {value!r} is not one of {', '.join(BACKENDS)}")
    return value


def _available(backend: str, device: torch.device) -> bool:
    if not dist.is_available():
        return False
    if backend == "nccl":  # NCCL moves CUDA tensors only
        return device.type == "cuda" and dist.is_nccl_available()
    if backend == "gloo":
        return dist.is_gloo_available()
    if backend == "mpi":
        return dist.is_mpi_available()
    return False


def choose_backend(
    requested: str, fallback: bool, device: torch.device, *, warn: bool = True
) -> str:
    """Pick the process-group backend.

    ``auto`` is NCCL for a CUDA device when NCCL is built in, else Gloo. An explicit request
    that cannot work here (NCCL on a CPU-only build or a CPU device, MPI without an MPI build)
    falls back to Gloo with one warning when ``fallback``, else raises. ``warn=False`` keeps the
    fallback message at debug level (ranks other than 0 take the same decision silently).
    """
    requested = resolve_backend_request(requested, None)
    if requested == "auto":
        chosen = "nccl" if _available("nccl", device) else "gloo"
        if not _available(chosen, device):
            raise MDTrainError("torch.distributed has neither NCCL nor Gloo in this PyTorch build")
        return chosen
    if _available(requested, device):
        return requested
    why = {
        "nccl": "NCCL needs a CUDA device and a PyTorch built with NCCL"
        f" (device here: {device.type}, NCCL built in: {dist.is_available() and dist.is_nccl_available()})",
        "mpi": "this PyTorch was built without MPI support",
        "gloo": "this PyTorch was built without Gloo",
    }[requested]
    if not fallback or requested == "gloo" or not _available("gloo", device):
        raise MDTrainError(f"backend {requested!r} is not available: {why}")
    log.log(
        logging.WARNING if warn else logging.DEBUG,
        "backend %r is not available (%s): using 'gloo'",
        requested,
        why,
    )
    return "gloo"
