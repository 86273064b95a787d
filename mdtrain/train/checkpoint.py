"""Checkpoints: atomic writes, rotation and RNG state (reading is `mdtrain.model.files`).

A checkpoint is one ``torch.save`` file holding a dict (only tensors and plain Python
containers/ints/floats/str/None, so that ``torch.load(weights_only=True)`` can read it and
loading never runs code)::

    {
      "format": "mdtrain-checkpoint",   # added by save_checkpoint
      "version": 1,                      # added by save_checkpoint
      "model_config": dict,              # JSON-able model section, rebuilds the module
      "model_state": dict,               # module.state_dict()
      "optimizer_state": dict,           # optimizer.state_dict() (zero_stage 1: the whole)
      "step": int,                       # number of completed optimiser steps
      "sampler_state": dict,             # TrainingSampler.state_dict()
      "rng_state": dict,                 # rng_state_dict(); per rank, e.g. {rank: ...}
      "mixed_precision": str | None,     # "tf32"/"bf16"/"fp16" the run trained in; None: off
      "loss_scale": dict,                # "fp16" only: LossScaler.state_dict()
      "config": dict,                    # the full input after defaults
      "ema": dict,                       # enable_ema: the weight average (mdtrain.train.ema)
      "stands_for": "live",              # best.ckpt-* of an EMA run: its live weights
    }

A checkpoint with ``"ema"`` stands for its averaged weights wherever a model is used
(`mdtrain.model.files.model_weights`); ``--restart`` reads the live weights and the average.

The learning curve is not part of it: ``lcurve.out`` is truncated to the resumed step instead.

Writes go to a temporary file in the same directory, are flushed and fsync'ed, then renamed
over the final name (and the directory fsync'ed), so a crash, a kill or a full disk at any
moment leaves either the previous or the new complete file under the final name.
`CheckpointManager` names files ``<prefix>-<step>.pt``, points ``<prefix>.pt`` (a symlink,
or a copy where symlinks fail) and the text file ``checkpoint`` at the newest one, keeps
``max_keep`` files, and finds the newest loadable one for ``--restart auto``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import uuid
from collections.abc import Callable
from typing import BinaryIO

import numpy as np
import torch

from mdtrain.errors import MDTrainError
from mdtrain.memory import is_oom_error, release_memory
from mdtrain.model.files import FORMAT, VERSION, checkpoint_io_error, load_checkpoint

log = logging.getLogger("mdtrain.checkpoint")


# ----------------------------------------------------------------------------- atomic I/O


def _tmp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _fsync_dir(directory: str) -> None:
    """Make a rename durable; not every platform/file system can open a directory."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: str, data: bytes | memoryview | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` (bytes, or a function writing to the open file) to ``path`` so that
    ``path`` is never seen partially written."""
    tmp = _tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Atomically write ``state`` (plus ``format``/``version``) to ``path``.

    A full disk or any other I/O failure raises `MDTrainError` naming the file; the temporary
    file is removed and a previous file under ``path`` stays intact. Running out of memory
    while writing is retried once, after releasing memory.
    """
    path = os.fspath(path)
    payload = {**state, "format": FORMAT, "version": VERSION}
    try:  # streamed into the file: no second copy of the checkpoint in memory
        try:
            _atomic_write(path, lambda f: torch.save(payload, f))
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            release_memory()  # what a training step left behind; then once more
            _atomic_write(path, lambda f: torch.save(payload, f))
    except OSError as exc:
        raise checkpoint_io_error(path, exc) from exc


# ----------------------------------------------------------------------------- RNG state


def rng_state_dict() -> dict:
    """RNG states of torch (CPU, and the current CUDA device if initialised), numpy's
    global generator and Python's ``random``, in ``weights_only``-loadable form."""
    np_state = np.random.get_state(legacy=False)
    py_version, py_internal, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": [int(k) for k in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_rng_state(state: dict) -> None:
    """Restore what `rng_state_dict` captured (CUDA only if available here)."""
    torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu().to(torch.uint8))
    npst = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": npst["bit_generator"],
            "state": {"key": np.asarray(npst["key"], dtype=np.uint32), "pos": npst["pos"]},
            "has_gauss": npst["has_gauss"],
            "gauss": npst["gauss"],
        }
    )
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))


# ----------------------------------------------------------------------------- rotation


class CheckpointManager:
    """``<out_dir>/<prefix>-<step>.pt`` files, the ``<prefix>.pt`` link and ``checkpoint``.

    ``prefix`` may contain a sub-directory (``"ckpt/model.ckpt"``). Only one process (rank 0)
    may use a manager on a directory. ``index`` False: the text file ``checkpoint`` is left
    alone (the averaged-weight checkpoints do not claim it, as in DeePMD-kit).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike = ".",
        prefix: str = "model.ckpt",
        max_keep: int = 5,
        index: bool = True,
    ) -> None:
        if max_keep < 1:
            raise MDTrainError(f"training.max_ckpt_keep must be >= 1, got {max_keep}")
        self.out_dir = os.fspath(out_dir)
        base = os.path.join(self.out_dir, prefix)
        self.directory = os.path.dirname(base) or "."
        self.stem = os.path.basename(base)
        self.max_keep = max_keep
        self.index = index
        self._pattern = re.compile(re.escape(self.stem) + r"-(\d+)\.pt")
        self._tmp_pattern = re.compile(r"\." + re.escape(self.stem) + r"[-.].*\.tmp")

    @property
    def link_path(self) -> str:
        """``<prefix>.pt``: always the newest checkpoint."""
        return os.path.join(self.directory, self.stem + ".pt")

    @property
    def index_path(self) -> str:
        """The text file ``checkpoint`` naming the newest checkpoint (relative to out_dir)."""
        return os.path.join(self.out_dir, "checkpoint")

    def owns(self, path: str | os.PathLike) -> bool:
        """``path`` is (a link to) one of this manager's files: ``<prefix>-<step>.pt`` or
        ``<prefix>.pt`` in its directory, files a run writes over."""
        path = os.path.abspath(os.fspath(path))
        if os.path.realpath(os.path.dirname(path)) != os.path.realpath(self.directory):
            return False
        name = os.path.basename(path)
        return bool(self._pattern.fullmatch(name)) or name == self.stem + ".pt"

    def path_for(self, step: int) -> str:
        return os.path.join(self.directory, f"{self.stem}-{step}.pt")

    def checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every ``<prefix>-<step>.pt``, oldest first."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = self._pattern.fullmatch(name)
            if m:
                found.append((int(m.group(1)), os.path.join(self.directory, name)))
        return sorted(found)

    def save(self, step: int, state: dict) -> str:
        """Write the checkpoint of ``step``, update link and index, rotate; returns its path.

        Checkpoints of later steps (left by an earlier run that went further) are renamed to
        ``<name>.superseded``, out of reach of ``--restart auto`` and of the rotation, so that
        a restart never jumps to a run that was abandoned and nothing written is deleted.
        """
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise checkpoint_io_error(self.directory, exc) from exc
        path = self.path_for(step)
        save_checkpoint(path, state)
        try:
            self._update_link(path)
        except OSError as exc:
            raise checkpoint_io_error(self.link_path, exc) from exc
        try:
            if self.index:
                _atomic_write(
                    self.index_path, (os.path.relpath(path, self.out_dir) + "\n").encode()
                )
        except OSError as exc:
            raise checkpoint_io_error(self.index_path, exc) from exc
        self._prune(step)
        return path

    def _update_link(self, path: str) -> None:
        tmp = _tmp_name(self.link_path)
        try:
            os.symlink(os.path.basename(path), tmp)
        except (OSError, NotImplementedError):  # no symlinks here: an atomic copy instead
            with open(path, "rb") as f:
                _atomic_write(self.link_path, f.read())
            return
        try:
            os.replace(tmp, self.link_path)
        except BaseException:
            os.unlink(tmp)
            raise
        _fsync_dir(self.directory)

    def _prune(self, step: int) -> None:
        ckpts = self.checkpoints()
        for s, p in ckpts:
            if s > step:
                self._set_aside(p, s, step)
        kept = [(s, p) for s, p in ckpts if s <= step]
        doomed = [p for _, p in kept[: -self.max_keep]]
        for name in os.listdir(self.directory):  # temp files of a killed writer
            if self._tmp_pattern.fullmatch(name):
                doomed.append(os.path.join(self.directory, name))
        for p in doomed:
            try:
                os.unlink(p)
            except OSError as exc:
                log.warning("could not remove old checkpoint %s: %s", p, exc.strerror)

    @staticmethod
    def _set_aside(path: str, step: int, now: int) -> None:
        """Rename a later-step checkpoint of an abandoned run (never overwriting one)."""
        target, n = f"{path}.superseded", 1
        while os.path.exists(target):
            target, n = f"{path}.superseded.{n}", n + 1
        try:
            os.replace(path, target)
        except OSError as exc:
            log.warning("could not set %s aside: %s", path, exc.strerror)
            return
        log.warning(
            "checkpoint %s is from a run that went further (step %d > %d): renamed to %s",
            path, step, now, os.path.basename(target),
        )  # fmt: skip

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[str, dict] | None:
        """Newest checkpoint that loads, with its state; corrupt ones are skipped with a
        warning. None when there is none."""
        for _, path in reversed(self.checkpoints()):
            try:
                return path, load_checkpoint(path, map_location=map_location)
            except MDTrainError as exc:
                log.warning("skipping unusable checkpoint: %s", exc)
        return None

    def latest(self) -> str | None:
        """Path of the newest checkpoint that loads (see `load_latest`)."""
        found = self.load_latest()
        return found[0] if found else None
