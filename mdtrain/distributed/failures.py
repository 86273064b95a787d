"""A failure on one rank ends every rank within seconds, with that rank's message.

Without this, a rank that raises leaves the others where they are: blocked in a collective
(NCCL need not notice a peer that left; Gloo does when its connection closes), waiting for rank
0's result, or busy with work of their own (rank 0's statistics), until
``training.distributed.timeout`` (30 min by default). So, inside ``with init_distributed(...)``:

- the failing rank writes one record, ``"<rank>\\n<message>"``, under one key of the job's
  store (the first failure wins: ``compare_set``) before its group goes down, and raises on
  as usual: its message is printed once, by itself;
- every rank runs a daemon thread that reads the key every second. On another rank's record
  it gives the main thread a moment to notice by itself (a Gloo collective fails at once when
  the peer's process exits); a main thread still stuck after that is ended from the thread:
  one line ``stopping: rank r failed: <message>``, logs flushed, ``os._exit(1)`` (a thread
  cannot interrupt a C++ collective). A store that stops answering (its host died) counts
  as a failure too;
- a rank whose own error is only the consequence (a collective that lost its peer) reports
  the record's line instead of its own ``Connection closed`` or ``lost contact``;
- the rank hosting the store (rank 0 outside torchrun) outlives the others' last look: after
  a failure it waits up to ``LINGER_S`` for them to acknowledge it, after a clean finish until
  every rank has stopped watching (else a slower rank would take the closed store for a
  failure).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time

import torch.distributed as dist

from mdtrain.errors import MDTrainError

log = logging.getLogger("mdtrain.distributed")

POLL_S = 1.0  # how often each rank reads the failure key
GRACE_S = 2.0  # how long the watcher lets a main thread that may have noticed handle it
LINGER_S = POLL_S + GRACE_S + 2.0  # how long a failed store host waits for the others
FINISH_WAIT_S = 60.0  # how long a store host waits at a clean finish for slower ranks

_FAILURE, _ACKS, _DONE = "first-failure", "acks", "done"


class PeerFailure(MDTrainError):
    """This rank stops because another rank failed (or could not be reached).

    ``quotes``: the message already carries that rank's own error (``run_on_main``'s
    ``rank 0: ...``), so it is kept as it is rather than replaced by the job's record.
    """

    def __init__(self, message: str, rank: int | None = None, *, quotes: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.quotes = quotes


def first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()[:500]
    return type(exc).__name__


def describe(exc: BaseException) -> str:
    """The one line a failure is published as: an MDTrainError's own text, else its type too."""
    if isinstance(exc, MDTrainError):
        return str(exc).strip()[:2000] or type(exc).__name__
    text = first_line(exc)
    return text if text == type(exc).__name__ else f"{type(exc).__name__}: {text}"


def is_consequence(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) only says that a peer went away: a
    collective that failed or timed out, or a ``PeerFailure``."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, (PeerFailure, dist.DistError)):
            return True
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and any(
            marker in text for marker in ("gloo", "nccl", "connection closed", "connection reset")
        ):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _flush_logs() -> None:
    for handler in logging.getLogger("mdtrain").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()


class FailureChannel:
    """The job's failure record in the store, the watcher thread, and the hand-over at the end.

    ``store`` is the job's store (each thread gets its own connection from ``clone``);
    ``hosts_store`` says whether this process serves it (its exit closes it for everyone).
    """

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, hosts_store: bool, where: str
    ) -> None:
        self.rank, self.world_size, self.hosts_store, self.where = (
            rank,
            world_size,
            hosts_store,
            where,
        )
        self._store = store  # held: on the host, the server lives as long as this object
        prefixed = dist.PrefixStore("mdtrain/failures/", store)
        self._main = prefixed.clone()  # the main thread's connection
        self._watch_store = prefixed.clone()  # the watcher's: a blocked call never blocks the other
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the watcher exits the process only while not stopped
        self._stopped = False
        self._acked = False
        self._thread: threading.Thread | None = None
        self.seen: tuple[int, str] | None = None  # another rank's record, once read

    # ------------------------------------------------------------------ the watcher thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="mdtrain-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (idempotent); from here on the main thread handles what comes."""
        with self._lock:
            self._stopped = True
            self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=POLL_S)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                record = _read(self._watch_store)
            except Exception as exc:  # the store's host died or stalls
                self._give_up(
                    f"stopping: lost contact with the job's store at {self.where} "
                    f"({first_line(exc)}): rank 0 or torchrun's agent, which serves it, "
                    "died or stalled"
                )
                return
            if record is not None and record[0] != self.rank:
                self.seen = record
                self._give_up(f"stopping: rank {record[0]} failed: {record[1]}")
                return

    def _give_up(self, line: str) -> None:
        if self._stop.wait(GRACE_S):  # the main thread got there: it reports
            return
        with self._lock:
            if self._stopped:
                return
            log.error("%s", line)
            _flush_logs()
            self._ack(self._watch_store)  # the host may close the store now
            os._exit(1)

    # ------------------------------------------------------------------ the main thread

    def report(self, exc: BaseException) -> BaseException | None:
        """The block of the run ended with ``exc``: publish it or recognise it as another
        rank's consequence. Returns the exception to raise instead, if any."""
        self.stop()
        record = self.seen or _quietly(_read, self._main)
        if record is None and not isinstance(exc, PeerFailure):  # its source publishes
            record = _quietly(_publish, self._main, self.rank, describe(exc))
        if record is not None and record[0] == self.rank:
            if self.hosts_store:
                atexit.register(self._linger)
            return None
        self._ack(self._main)
        if record is None or not isinstance(exc, Exception) or not is_consequence(exc):
            return None  # an error of this rank's own, or nothing better to say: keep it
        if isinstance(exc, PeerFailure) and exc.quotes:
            return None
        return PeerFailure(f"stopping: rank {record[0]} failed: {record[1]}", record[0])

    def finish(self) -> None:
        """A clean end: stop watching, say so, and (store host) wait for the others to."""
        self.stop()
        try:
            self._main.add(_DONE, 1)
            deadline = time.monotonic() + FINISH_WAIT_S
            while self.hosts_store and time.monotonic() < deadline:
                if self._main.add(_DONE, 0) >= self.world_size or self._main.check([_FAILURE]):
                    break
                time.sleep(0.05)
        except Exception as exc:  # nothing left to protect
            log.debug("clean finish not recorded in the store: %s", first_line(exc))

    def _ack(self, store: dist.Store) -> None:
        if not self._acked:
            self._acked = True
            _quietly(store.add, _ACKS, 1)

    def _linger(self) -> None:
        """At exit of a failed store host: keep the store up until the others have read."""
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            acks = _quietly(self._main.add, _ACKS, 0)
            if acks is None or acks >= self.world_size - 1:
                return
            time.sleep(0.05)


def _read(store: dist.Store) -> tuple[int, str] | None:
    if not store.check([_FAILURE]):
        return None
    return _parse(store.get(_FAILURE))


def _publish(store: dist.Store, rank: int, message: str) -> tuple[int, str] | None:
    """Write this rank's record unless one is there already; the record that stands."""
    return _parse(store.compare_set(_FAILURE, "", f"{rank}\n{message}"))


def _parse(value: bytes) -> tuple[int, str] | None:
    rank, _, message = value.decode(errors="replace").partition("\n")
    return (int(rank), message) if rank.strip().isdigit() else None


def _quietly(fn, *args):  # noqa: ANN001, ANN202
    """``fn(*args)``, or None when the store cannot be reached (the failure being reported
    matters more than the bookkeeping)."""
    try:
        return fn(*args)
    except Exception as exc:
        log.debug("store unreachable while handling a failure: %s", first_line(exc))
        return None
