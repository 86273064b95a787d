"""``lcurve.out``: the learning curve in DeePMD's column format.

Header (keys sorted; ``_val`` columns only when there is validation data)::

    # step        rmse_val    rmse_trn  rmse_e_val  rmse_e_trn ...   lr
    # If there is no available reference data, rmse_*_{val,trn} will print nan

Rows: ``f"{step:7d}"``, then ``"   %11.2e %11.2e" % (val, trn)`` per key (``"   %11.2e"``
without validation), then ``f"   {lr:8.1e}"``. Every row is flushed, so the file can be
watched while training runs. On restart the rows after the resumed step are dropped first,
so a resumed run never duplicates rows. Only rank 0 writes it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence

log = logging.getLogger("mdtrain.lcurve")

NOTE = "# If there is no available reference data, rmse_*_{val,trn} will print nan\n"


def header(keys: Sequence[str], has_validation: bool) -> str:
    """The two header lines for ``keys`` (sorted here)."""
    text = "# {:5s}".format("step")
    for k in sorted(keys):
        text += (
            "   {:>11s} {:>11s}".format(k + "_val", k + "_trn")
            if has_validation
            else "   {:>11s}".format(k + "_trn")
        )
    return text + "   {:8s}\n".format("lr") + NOTE


def _row_step(line: str) -> int | None:
    """Step of a complete data row; None for comments or a torn last line."""
    if not line.endswith("\n") or line.startswith("#"):
        return None
    fields = line.split()
    if not fields:
        return None
    try:
        int(fields[0])
        [float(f) for f in fields[1:]]
    except ValueError:
        return None
    return int(fields[0])


def truncate_after(path: str | os.PathLike, step: int) -> int:
    """Drop data rows with a step > ``step`` (and a torn last line); returns rows dropped.

    The file is rewritten atomically; a missing file is left missing.
    """
    path = os.fspath(path)
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return 0
    kept = []
    for line in lines:
        s = _row_step(line)
        if line.startswith("#") and line.endswith("\n") or s is not None and s <= step:
            kept.append(line)
    dropped = len(lines) - len(kept)
    if dropped:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class LcurveWriter:
    """Appends one row per display step to ``lcurve.out``.

    ``append=False`` starts a new file with the header; ``append=True`` continues an existing
    one (first dropping rows after ``resume_step`` when given, and a torn last row), writing the header only if the
    file is missing or empty. ``mirror`` (a `mdtrain.train.tensorboard.TensorboardWriter`)
    is handed every row too. Use as a context manager or call `close`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        keys: Sequence[str],
        has_validation: bool,
        append: bool,
        resume_step: int | None = None,
        mirror=None,  # noqa: ANN001 (any object with write/close)
    ) -> None:
        self.mirror = mirror
        self.path = os.fspath(path)
        self.keys = sorted(keys)
        self.has_validation = has_validation
        head = header(self.keys, has_validation)
        if append:  # also removes a row torn by a kill, so the next one starts a new line
            last = resume_step if resume_step is not None else sys.maxsize
            dropped = truncate_after(self.path, last)
            if dropped:
                log.info("dropped %d rows after step %d from %s", dropped, last, self.path)
        existing = ""
        if append and os.path.exists(self.path):
            with open(self.path) as f:
                existing = f.readline()
            if existing and existing != head.splitlines(keepends=True)[0]:
                log.warning(
                    "%s: the columns differ from this run's (%s); appending anyway",
                    self.path,
                    " ".join(self.keys),
                )
        self._file = open(self.path, "a" if append else "w")  # noqa: SIM115 (kept open)
        if not existing:
            self._file.write(head)
            self._file.flush()

    def truncate_after(self, step: int) -> int:
        """Drop rows after ``step`` from the open file (see module function)."""
        self._file.close()
        dropped = truncate_after(self.path, step)
        self._file = open(self.path, "a")  # noqa: SIM115 (kept open)
        return dropped

    def write(
        self,
        step: int,
        lr: float,
        train: Mapping[str, float],
        valid: Mapping[str, float] | None = None,
    ) -> None:
        """One row; missing keys print as nan; values may be floats or 0-d tensors."""

        def get(d: Mapping | None, k: str) -> float:
            return float(d[k]) if d is not None and k in d else math.nan

        row = f"{step:7d}"
        for k in self.keys:
            if self.has_validation:
                row += f"   {get(valid, k):11.2e} {get(train, k):11.2e}"
            else:
                row += f"   {get(train, k):11.2e}"
        row += f"   {lr:8.1e}\n"
        self._file.write(row)
        self._file.flush()
        if self.mirror is not None:
            self.mirror.write(step, lr, train, valid)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None

    def __enter__(self) -> LcurveWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
