"""Out-of-memory recovery during training, without changing what is optimised.

The configured batch is the optimisation batch. When a step runs out of memory it is retried
as ``n`` contiguous micro-batches whose gradients are accumulated (each micro-batch loss
weighted by its share of frames), which gives the full-batch gradient.

The split is remembered **per size**: the memory of a step grows with the atoms it holds
(frames × atoms per frame; every atom has the same padded neighbour list), so a size that ran
out of memory says nothing about smaller ones. Each size has its own state (``SizeState``):

- a size starts whole (or at ``micro_batches``, the user's fixed split, a floor), or, when a
  smaller size is already split further, with micro-batches no larger than the largest that
  a split size runs: ``ceil(size * k / K)`` for the size ``K`` split ``k`` with the largest
  ``K / k`` (memory grows with the atoms, so a larger size surely needs a split too);
- ``n`` doubles on every OOM of the size; a batch of ``nframes`` uses ``min(n, nframes)``
  balanced contiguous slices. An OOM with one frame per micro-batch is fatal (MDTrainError
  naming the system and atom count);
- after ``retry_interval`` successes *of that size* ``n`` is halved (never below the floor);
  if the halved split runs out of memory before ``retry_interval`` successes, that size's
  wait doubles, so a rarely drawn size pays one or two OOMs a run, a frequent one a
  logarithmic number.

Several ranks: ``run_step`` makes the same collective calls on every rank (one per attempt, one
or two more after an agreed OOM), so all ranks retry together and fail together, each with
its own split for its own size. A rank whose attempt succeeded keeps its gradients and only
takes part in the votes while the others retry.

``grow=True`` (for ``batch_size: "auto"``) is agreed by every rank: after ``retry_interval``
steps without an OOM on any rank ``batch_scale`` doubles up to ``max_scale`` (the caller
multiplies its automatic batch sizes by it). An OOM at a grown scale on any rank, other than
a size's own trial of fewer micro-batches, halves the scale and caps it there for the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from mdtrain.errors import MDTrainError
from mdtrain.memory import is_oom_error, oom_site, release_memory

STATE_VERSION = 2


def _local_only(flag: bool) -> bool:
    """The agreement rule of a single process: nobody else to ask."""
    return flag


def split_frames(nframes: int, nsplit: int) -> list[slice]:
    """``min(nsplit, nframes)`` contiguous slices of ``range(nframes)`` whose sizes differ by at
    most one (larger ones first)."""
    if nframes <= 0:
        raise ValueError("nframes must be positive")
    parts = max(1, min(nsplit, nframes))
    base, extra = divmod(nframes, parts)
    slices, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        slices.append(slice(start, stop))
        start = stop
    return slices


def frame_weights(slices: list[slice], nframes: int) -> list[float]:
    """Weight of each micro-batch's loss (mean over its frames) so that the weighted sum equals
    the loss of the whole batch (mean over all frames): its share of the frames."""
    return [(s.stop - s.start) / nframes for s in slices]


@dataclass
class SizeState:
    """What the controller learned about one size (frames × atoms of a batch)."""

    nsplit: int  # micro-batches for the next batch of this size
    wait: int  # successes required before trying fewer micro-batches
    successes: int = 0  # successful steps of this size since its split last changed
    trial: bool = False  # nsplit is an unproven halving
    ooms: int = 0  # out-of-memory errors of this size in this run (and the ones restarted)


class MicroBatchController:
    """Decides how each training batch is split into micro-batches, per size, after OOMs."""

    def __init__(
        self,
        retry_interval: int = 200,
        grow: bool = False,
        max_scale: int = 1,
        micro_batches: int | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        if retry_interval <= 0:
            raise ValueError("retry_interval must be positive")
        if micro_batches is not None and micro_batches < 1:
            raise ValueError("micro_batches must be at least 1")
        self.retry_interval = retry_interval
        self.grow = grow
        self.max_scale = max(1, max_scale)
        self.floor = micro_batches or 1  # the user's fixed split: never fewer micro-batches
        self.log = log or logging.getLogger("mdtrain.train.batch")
        self.sizes: dict[int, SizeState] = {}
        self.default: SizeState | None = None  # an old checkpoint's global split, for new sizes
        self.batch_scale = 1
        self.scale_cap = self.max_scale  # lowered when a grown size ran out of memory
        self.clean = 0  # steps without an OOM on any rank since the last OOM or growth
        self.oom_count = 0  # agreed OOM events (identical on every rank)

    # ------------------------------------------------------------------ queries
    def micro_batches(self, nframes: int, natoms: int) -> int:
        """Micro-batches for the next batch of ``nframes`` frames of ``natoms`` atoms."""
        size = nframes * natoms
        known = self.sizes.get(size)
        return max(self.floor, known.nsplit) if known else self._inherited(size)[0]

    def split(self, nframes: int, natoms: int) -> list[slice]:
        """The micro-batches of the next batch of this size."""
        return split_frames(nframes, self.micro_batches(nframes, natoms))

    def suggest_growth(self) -> int:
        """Factor by which the caller multiplies its automatic batch sizes (1 unless ``grow``)."""
        return self.batch_scale

    # ------------------------------------------------------------------ events of this rank
    def on_success(self, nframes: int, natoms: int, nsplit: int) -> None:
        """Count a batch of this size completed with ``nsplit`` micro-batches; after enough of
        them, try fewer."""
        state = self.sizes.get(nframes * natoms)
        if state is None or nsplit != state.nsplit:
            return  # whole at the floor (nothing to learn), or a retry count of this step
        state.successes += 1
        if state.trial and state.successes >= self.retry_interval:
            state.trial, state.wait = False, self.retry_interval  # the halving held
        fewer = max(self.floor, (state.nsplit + 1) // 2)
        if fewer < state.nsplit and state.successes >= state.wait:
            self.log.info(
                "batch controller: %d successful steps of %d frames of %d atoms, trying %d "
                "micro-batch(es)", state.wait, nframes, natoms, fewer,
            )  # fmt: skip
            state.nsplit, state.successes, state.trial = fewer, 0, True

    def on_oom(self, nframes: int, natoms: int, system_name: str, nsplit: int) -> int:
        """Record an OOM of a batch of this size tried as ``nsplit`` micro-batches; return the
        count for retrying it. Raises MDTrainError when a micro-batch held a single frame."""
        if min(nsplit, nframes) >= nframes:
            raise MDTrainError(self._too_large(system_name, natoms))
        state = self._state(nframes * natoms)
        if state.trial and nsplit == state.nsplit:
            state.wait *= 2  # the halving did not hold: wait longer before trying again
        state.nsplit, state.successes, state.trial = 2 * nsplit, 0, False
        state.ooms += 1
        self.log.info(
            "batch controller: out of memory (system %s, %d frames of %d atoms); batches of "
            "this size now run as up to %d micro-batches",
            system_name, nframes, natoms, state.nsplit,
        )  # fmt: skip
        return state.nsplit

    # ------------------------------------------------------------------ agreed events
    def on_step(self) -> None:
        """A step succeeded on every rank: the growth clock (identical on every rank)."""
        self.clean += 1
        if self.grow and self.clean >= self.retry_interval and self.batch_scale < self.scale_cap:
            self.batch_scale = min(2 * self.batch_scale, self.scale_cap)
            self.clean = 0
            self.log.info("batch controller: batch sizes grown by a factor %d", self.batch_scale)

    def on_agreed_oom(self, blame_growth: bool) -> None:
        """Some rank ran out of memory (every rank calls this, with the same argument)."""
        self.oom_count += 1
        self.clean = 0
        if blame_growth and self.batch_scale > 1:
            self.batch_scale //= 2
            self.scale_cap = self.batch_scale
            self.log.info(
                "batch controller: out of memory at a grown batch; batch sizes reverted to a "
                "factor %d for the rest of the run", self.batch_scale,
            )  # fmt: skip

    # ------------------------------------------------------------------ the step driver
    def run_step(
        self,
        attempt_fn: Callable[[list[slice]], Any],
        nframes: int,
        natoms: int,
        system_name: str,
        any_rank: Callable[[bool], bool] = _local_only,
        *,
        zero_grad: Callable[[], None] | None = None,
        before_vote: Callable[[], None] | None = None,
    ) -> Any:
        """Run one training step's local work, retrying with smaller micro-batches on OOM.

        ``attempt_fn(slices)`` computes and accumulates the local gradients of every micro-batch
        (weighting each loss with :func:`frame_weights`) without any collective; its result is
        returned. ``any_rank(flag)`` is a collective that returns True if any rank passed True,
        called the same number of times on every rank: once per attempt; after an agreed OOM
        once more to agree whether a rank cannot split further (then every rank raises
        MDTrainError together), and, at a grown ``batch_scale``, once more to agree whether to
        shrink it. ``zero_grad`` is called before every attempt of this rank. A rank whose
        attempt succeeded keeps its gradients while others retry. The caller all-reduces the
        gradients and steps the optimiser after this returns.

        ``before_vote()`` is called on every rank once per attempt, just before the attempt's
        vote, whether this rank attempted, succeeded or failed: the trainer completes there
        the gradient all-reduces its backward started (see ``GradientBuckets``), so that every
        rank has issued the same collectives when it votes.

        An exception that is not an OOM propagates at once on the rank that raised it.
        """
        count = self._start(nframes * natoms)
        done, result = False, None
        while True:
            oom = False
            if not done:
                if zero_grad is not None:
                    zero_grad()
                try:
                    result = attempt_fn(split_frames(nframes, count))
                    done = True
                except Exception as exc:
                    if not is_oom_error(exc):
                        raise
                    oom = True
                    self.log.warning(
                        "out of memory on system %s (%d frames of %d atoms, %d micro-batch(es)) "
                        "at %s", system_name, nframes, natoms, min(count, nframes), oom_site(exc),
                    )  # fmt: skip
                if done:
                    self.on_success(nframes, natoms, count)
            if before_vote is not None:
                before_vote()
            if not any_rank(oom):
                self.on_step()
                return result
            if oom:
                if zero_grad is not None:
                    zero_grad()
                release_memory()
            stuck = oom and min(count, nframes) >= nframes
            if any_rank(stuck):
                if stuck:
                    raise MDTrainError(self._too_large(system_name, natoms))
                raise MDTrainError(
                    "out of memory on another rank with a single frame per micro-batch "
                    "(see that rank's error)"
                )
            blame = False
            if self.batch_scale > 1:  # agreed on every rank, so is this extra vote
                blame = any_rank(oom and not self._is_trial(nframes * natoms, count))
            self.on_agreed_oom(blame)
            if oom:
                count = self.on_oom(nframes, natoms, system_name, count)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a restart needs to avoid repeating the OOMs already seen (plain types)."""
        return {
            "version": STATE_VERSION,
            "sizes": [{"size": k, **asdict(v)} for k, v in sorted(self.sizes.items())],
            "default": None if self.default is None else asdict(self.default),
            "batch_scale": self.batch_scale,
            "scale_cap": self.scale_cap,
            "clean": self.clean,
            "oom_count": self.oom_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state of this version, or an old checkpoint's single global split (which
        becomes the starting split of every size until each size's own clock lowers it)."""
        if "sizes" not in state:  # version 1: one split for every batch
            self.sizes = {}
            nsplit = int(state["nsplit"])
            self.default = None
            if nsplit > 1:
                self.default = SizeState(nsplit, int(state["wait"]), trial=bool(state["trial"]))
            self.clean = int(state["successes"]) if nsplit == 1 else 0
        else:
            self.sizes = {
                int(e["size"]): SizeState(
                    int(e["nsplit"]),
                    int(e["wait"]),
                    int(e["successes"]),
                    bool(e["trial"]),
                    int(e["ooms"]),
                )  # fmt: skip
                for e in state["sizes"]
            }
            d = state.get("default")
            self.default = (
                None
                if d is None
                else SizeState(int(d["nsplit"]), int(d["wait"]), 0, bool(d["trial"]))
            )
            self.clean = int(state["clean"])
        self.batch_scale = int(state["batch_scale"])
        self.scale_cap = int(state["scale_cap"])
        self.oom_count = int(state["oom_count"])

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _too_large(system_name: str, natoms: int) -> str:
        return (
            f"system {system_name}: a single frame of {natoms} atoms does not fit in memory; "
            "use a device with more memory or a smaller model (sel, neuron sizes)"
        )

    def _inherited(self, size: int) -> tuple[int, SizeState | None]:
        """Starting split of an unseen size, and the state it copies its clock from: when a
        smaller size is split, micro-batches no larger than the largest a split size runs."""
        best, source = self.floor, None
        if self.default is not None and self.default.nsplit > best:
            best, source = self.default.nsplit, self.default
        split = [(k, s.nsplit) for k, s in self.sizes.items() if s.nsplit > self.floor]
        if any(known < size for known, _ in split):
            known, n = max(split, key=lambda e: Fraction(e[0], e[1]))  # its micro-batch size
            count = -(-size * n // known)
            if count > best:
                best, source = count, None
        return best, source

    def _start(self, size: int) -> int:
        """Micro-batches for a step of this size; an unseen size that starts split gets its
        own state (and clock) here."""
        known = self.sizes.get(size)
        if known is not None:
            return max(self.floor, known.nsplit)
        count, source = self._inherited(size)
        if count > self.floor:
            wait = self.retry_interval if source is None else source.wait
            trial = source is not None and source.trial
            self.sizes[size] = SizeState(count, wait, trial=trial)
        return count

    def _state(self, size: int) -> SizeState:
        if size not in self.sizes:
            self.sizes[size] = SizeState(self.floor, self.retry_interval)
        return self.sizes[size]

    def _is_trial(self, size: int, nsplit: int) -> bool:
        """Whether a batch of this size run as ``nsplit`` was a trial of fewer micro-batches."""
        state = self.sizes.get(size)
        return state is not None and state.trial and nsplit == state.nsplit


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One restart state from every rank's (the first one's agreed fields): every size any rank
    knows, with the largest split a rank needed for it."""
    merged = dict(states[0])
    table: dict[int, dict[str, Any]] = {}
    for state in states:
        for entry in state.get("sizes", []):
            have = table.get(entry["size"])
            if have is None or entry["nsplit"] > have["nsplit"]:
                table[entry["size"]] = entry
    merged["sizes"] = [table[k] for k in sorted(table)]
    return merged
