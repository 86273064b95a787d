"""Out-of-memory recovery during training, without changing what is optimised.

The configured batch is the optimisation batch. When a step runs out of memory it is retried,
on every rank together, as ``nsplit`` contiguous micro-batches whose gradients are accumulated
(each micro-batch loss weighted by its share of frames), which gives the full-batch gradient.

Policy (deterministic, identical on every rank because it only depends on agreed events):

- ``nsplit`` starts at 1 and doubles on every OOM (1, 2, 4, 8, ...); a batch of ``nframes``
  uses ``min(nsplit, nframes)`` balanced contiguous slices. An OOM when every micro-batch
  already holds one frame is fatal (MDTrainError naming the system and atom count).
- After ``retry_interval`` successful steps ``nsplit`` is halved again (memory use can drop,
  e.g. after a large system was seen or the allocator cache settled). If the halved split runs
  out of memory before ``retry_interval`` successes, the wait before the next try doubles, so a
  split that really is needed costs a logarithmic number of wasted attempts.
- ``grow=True`` (for ``batch_size: "auto"``): with ``nsplit == 1``, after ``retry_interval``
  successes ``batch_scale`` doubles up to ``max_scale``; the caller multiplies its automatic
  batch sizes by ``batch_scale``. An OOM at a grown size reverts to the last working scale
  (which is never grown past again) and retries the drawn batch in two halves instead of
  splitting later steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mdtrain.errors import MDTrainError
from mdtrain.memory import is_oom_error, release_memory


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


class MicroBatchController:
    """Decides how a training batch is split into micro-batches after out-of-memory errors."""

    def __init__(
        self,
        retry_interval: int = 200,
        grow: bool = False,
        max_scale: int = 1,
        log: logging.Logger | None = None,
    ) -> None:
        if retry_interval <= 0:
            raise ValueError("retry_interval must be positive")
        self.retry_interval = retry_interval
        self.grow = grow
        self.max_scale = max(1, max_scale)
        self.log = log or logging.getLogger("mdtrain.train.batch")
        self.nsplit = 1
        self.best_nsplit: int | None = None  # smallest nsplit that completed a step
        self.batch_scale = 1
        self.scale_cap = self.max_scale  # lowered when a grown size ran out of memory
        self.successes = 0  # successful steps since the last change
        self.wait = retry_interval  # successes required before trying a smaller nsplit
        self._trial = False  # the current nsplit is an unproven halving
        self.oom_count = 0

    # ------------------------------------------------------------------ queries
    def split(self, nframes: int, nsplit: int | None = None) -> list[slice]:
        """The micro-batches of a batch of ``nframes`` frames (default: current ``nsplit``)."""
        return split_frames(nframes, self.nsplit if nsplit is None else nsplit)

    def suggest_growth(self) -> int:
        """Factor by which the caller multiplies its automatic batch sizes (1 unless ``grow``)."""
        return self.batch_scale

    # ------------------------------------------------------------------ events
    def on_success(self, nsplit: int | None = None) -> None:
        """Count a step completed with ``nsplit`` micro-batches (default: current); after enough
        of them, try a smaller split or a larger batch."""
        self.successes += 1
        ran = self.nsplit if nsplit is None else nsplit
        if self.best_nsplit is None or ran < self.best_nsplit:
            self.best_nsplit = ran
        if self._trial and self.successes >= self.retry_interval:
            self._trial = False
            self.wait = self.retry_interval  # the halving held: back to the normal pace
        if self.nsplit > 1:
            if self.successes >= self.wait:
                self._set_nsplit(self.nsplit // 2, trial=True)
                self.log.info(
                    "batch controller: %d successful steps, trying %d micro-batch(es) per batch",
                    self.wait,
                    self.nsplit,
                )
        elif self.grow and self.successes >= self.retry_interval:
            bigger = min(2 * self.batch_scale, self.scale_cap)
            if bigger > self.batch_scale:
                self.batch_scale = bigger
                self.successes = 0
                self.log.info("batch controller: batch sizes grown by a factor %d", bigger)

    def on_oom(self, nframes: int, natoms: int, system_name: str, nsplit: int | None = None) -> int:
        """Record an OOM on a batch of ``nframes`` frames of ``natoms`` atoms tried as ``nsplit``
        micro-batches (default: current) and return the number of micro-batches for retrying the
        same batch. Raises MDTrainError when a micro-batch already holds a single frame."""
        tried = self.nsplit if nsplit is None else nsplit
        if min(tried, nframes) >= nframes:
            raise MDTrainError(self._too_large(system_name, natoms))
        return self._after_oom(tried, nframes, natoms, system_name)

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
    ) -> Any:
        """Run one training step's local work, retrying with smaller micro-batches on OOM.

        ``attempt_fn(slices)`` computes and accumulates the local gradients of every micro-batch
        (weighting each loss with :func:`frame_weights`) without synchronising gradients across
        ranks; its result is returned. ``any_rank(flag)`` is a collective that returns True if
        any rank passed True. It is called the same number of times on every rank: once per
        attempt, plus once after an agreed OOM to agree whether any rank cannot split further
        (then every rank raises MDTrainError together). ``zero_grad`` is called before every
        attempt so a retry starts from clean gradients. The caller all-reduces the gradients
        and steps the optimiser after this returns.

        An exception that is not an OOM propagates at once on the rank that raised it.
        """
        count = self.nsplit
        while True:
            if zero_grad is not None:
                zero_grad()
            oom = False
            result = None
            try:
                result = attempt_fn(self.split(nframes, count))
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                oom = True
                self.log.warning(
                    "out of memory on system %s (%d frames of %d atoms, %d micro-batch(es))",
                    system_name,
                    nframes,
                    natoms,
                    min(count, nframes),
                )
            if not any_rank(oom):
                self.on_success(count)
                return result
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
            count = self._after_oom(count, nframes, natoms, system_name)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a restart needs to avoid repeating the OOMs already seen."""
        return {
            "nsplit": self.nsplit,
            "best_nsplit": self.best_nsplit,
            "batch_scale": self.batch_scale,
            "scale_cap": self.scale_cap,
            "successes": self.successes,
            "wait": self.wait,
            "trial": self._trial,
            "oom_count": self.oom_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.nsplit = int(state["nsplit"])
        self.best_nsplit = state["best_nsplit"]
        self.batch_scale = int(state["batch_scale"])
        self.scale_cap = int(state["scale_cap"])
        self.successes = int(state["successes"])
        self.wait = int(state["wait"])
        self._trial = bool(state["trial"])
        self.oom_count = int(state["oom_count"])

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _too_large(system_name: str, natoms: int) -> str:
        return (
            f"system {system_name}: a single frame of {natoms} atoms does not fit in memory; "
            "use a device with more memory or a smaller model (sel, neuron sizes)"
        )

    def _set_nsplit(self, nsplit: int, trial: bool) -> None:
        self.nsplit = nsplit
        self.successes = 0
        self._trial = trial

    def _after_oom(self, tried: int, nframes: int, natoms: int, system_name: str) -> int:
        """Update the policy after an agreed OOM; return the micro-batch count for the retry."""
        self.oom_count += 1
        if self.grow and self.batch_scale > 1 and tried == 1:
            self.batch_scale //= 2
            self.scale_cap = self.batch_scale
            self.successes = 0
            self.log.info(
                "batch controller: out of memory at a grown batch; batch sizes reverted to "
                "a factor %d (this step runs as 2 micro-batches)",
                self.batch_scale,
            )
            return 2
        if self._trial:
            self.wait *= 2  # the halving did not hold: wait longer before trying again
        self._set_nsplit(2 * tried, trial=False)
        self.log.info(
            "batch controller: out of memory (system %s, %d frames of %d atoms); each batch "
            "now runs as up to %d micro-batches",
            system_name,
            nframes,
            natoms,
            self.nsplit,
        )
        return self.nsplit
