"""Preemption: turn SIGTERM/SIGUSR1 into a flag so training can stop cleanly.

Batch schedulers send SIGTERM (Slurm also SIGUSR1 with ``--signal``) some time before
killing a job. With the handler installed the process keeps running; the loop checks
`PreemptionHandler.requested` (all-reduced across ranks, so every rank stops at the same
step), finishes the current step, writes a checkpoint and exits. Handlers can only be
installed from the main thread; elsewhere `install` does nothing and says so in the log.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable

log = logging.getLogger("mdtrain.signals")


def _default_signals() -> tuple[int, ...]:
    names = ("SIGTERM", "SIGUSR1")
    return tuple(getattr(signal, n) for n in names if hasattr(signal, n))


class PreemptionHandler:
    """Sets `requested` on SIGTERM or SIGUSR1 instead of letting them end the process."""

    def __init__(self, signals: Iterable[int] | None = None) -> None:
        self.signals = tuple(signals) if signals is not None else _default_signals()
        self._previous: dict[int, object] = {}
        self._received: int | None = None

    @property
    def requested(self) -> bool:
        """True once one of the signals has arrived."""
        return self._received is not None

    @property
    def signal_name(self) -> str | None:
        """Name of the first signal received (e.g. ``"SIGTERM"``), None if none."""
        return signal.Signals(self._received).name if self._received is not None else None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _handle(self, signum: int, frame) -> None:
        if self._received is None:  # only set a flag: logging here could re-enter a lock
            self._received = signum

    def install(self) -> PreemptionHandler:
        """Install the handlers (main thread only), remembering the previous ones."""
        if self._previous:
            return self
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: preemption signals are not handled")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, old in self._previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()
