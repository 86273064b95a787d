"""Learning curves from a DeePMD-compatible ``lcurve.out``: read and draw (for `mdtrain plot`).

The file is a header comment naming the columns (``step``, ``rmse_val``, ``rmse_trn``, ...,
``lr``; the training-only form has no ``_val`` columns), further comment lines, and one row of
numbers per displayed step, where a metric without reference data reads ``nan``. A restart
appends rows and may repeat the header; a repeated header must name the same columns. A last
line without its newline is a row still being written (or torn by a kill) and is skipped, so a
running training can be plotted.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from mdtrain.errors import MDTrainError

log = logging.getLogger("mdtrain.plot")

# Titles and units of the metric groups; other rmse_* groups get their own name as title.
_TITLES = {
    "rmse": "total (√loss)",
    "rmse_e": "energy RMSE (eV/atom)",
    "rmse_f": "force RMSE (eV/Å)",
    "rmse_v": "virial RMSE (eV/atom)",
}
_SPLITS = (("_trn", "train"), ("_val", "validation"))


def parse_lcurve(path: str | Path) -> dict[str, np.ndarray]:
    """Columns of an lcurve file by name: ``step`` as int64, every other column float64.

    Raises MDTrainError naming the file (and line) when it is missing, has no header, or a row
    does not match the header.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise MDTrainError(
            f"{path}: no such file (expected an lcurve.out written by training)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MDTrainError(f"{path}: cannot read: {exc}") from None

    lines = text.splitlines()
    # A last line without its newline may be a row still being written (training is running)
    # or torn by a kill: it is kept only if it is a complete row.
    unfinished = lines.pop() if lines and not text.endswith("\n") else None
    names: list[str] | None = None
    rows: list[list[float]] = []
    for lineno, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            tokens = stripped.lstrip("#").split()
            if tokens and tokens[0] == "step":  # a header; other comment lines are skipped
                if names is not None and tokens != names:
                    raise MDTrainError(
                        f"{path}:{lineno}: header names columns {tokens}, the first header {names}"
                    )
                names = tokens
            continue
        if names is None:
            raise MDTrainError(f"{path}:{lineno}: data before the header line '# step ...'")
        fields = stripped.split()
        if len(fields) != len(names):
            raise MDTrainError(
                f"{path}:{lineno}: {len(fields)} values, the header names {len(names)} columns"
            )
        try:
            rows.append([float(f) for f in fields])
        except ValueError:
            bad = next(f for f in fields if not _is_float(f))
            raise MDTrainError(f"{path}:{lineno}: {bad!r} is not a number") from None
    if unfinished is not None and names is not None:
        fields = unfinished.split()
        if len(fields) == len(names) and all(_is_float(f) for f in fields):
            rows.append([float(f) for f in fields])
        else:
            log.debug("%s: skipping the unfinished last line %r", path, unfinished)
    if names is None:
        raise MDTrainError(f"{path}: no header line '# step ...'; is this an lcurve.out file?")

    table = np.array(rows, dtype=np.float64).reshape(len(rows), len(names))
    columns = {name: table[:, k] for k, name in enumerate(names)}
    columns["step"] = columns["step"].astype(np.int64)
    return columns


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def metric_groups(columns: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """``{"rmse_e": {"train": ..., "validation": ...}, ...}`` for the columns with any finite value.

    Groups come in file order; a split that is all ``nan`` (no reference data) is left out, and
    so is a group with nothing left.
    """
    groups: dict[str, dict[str, np.ndarray]] = {}
    for name, values in columns.items():
        for suffix, label in _SPLITS:
            if name.endswith(suffix) and np.isfinite(values).any():
                groups.setdefault(name[: -len(suffix)], {})[label] = values
    return groups


def plot_lcurve(columns: dict[str, np.ndarray], output: str | Path, title: str = "") -> Path:
    """Draw one log-scale panel per metric group and one for the learning rate; save to output."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no display, no global backend
    from matplotlib.figure import Figure

    output = Path(output)
    step = columns["step"]
    groups = metric_groups(columns)
    has_lr = "lr" in columns and np.isfinite(columns["lr"]).any()
    npanels = len(groups) + int(has_lr)
    if npanels == 0:
        raise MDTrainError(f"{title or 'lcurve'}: no metric has a finite value; nothing to plot")
    ncols = 1 if npanels == 1 else 2
    nrows = math.ceil(npanels / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, sharex=True, squeeze=False).ravel()

    for ax, (group, splits) in zip(axes, groups.items()):
        for label, values in splits.items():
            ax.plot(
                step, _positive(values), label=label, lw=1.2, marker="." if len(step) < 50 else None
            )
        ax.set_title(_TITLES.get(group, group))
        _log_axis(ax)
        ax.legend()
    if has_lr:
        ax = axes[len(groups)]
        ax.plot(step, _positive(columns["lr"]), color="tab:green", lw=1.2)
        ax.set_title("learning rate")
        _log_axis(ax)
    for ax in axes[npanels:]:
        ax.set_visible(False)
    for ax in axes[:npanels]:
        ax.set_xlabel("step")
        ax.tick_params(labelbottom=True)  # sharex hides them above the last row
    if title:
        fig.suptitle(title)
    try:
        fig.savefig(output, dpi=120)
    except (OSError, ValueError) as exc:
        raise MDTrainError(f"{output}: cannot write the plot: {exc}") from None
    return output


def _log_axis(ax) -> None:
    """Log y axis with plain numbers (0.2, 1e-05) rather than 2×10⁻¹ on the labelled ticks."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x, pos=None):  # keep the base class's choice of which ticks to label
            return f"{x:.3g}" if super().__call__(x, pos) else ""

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PlainLogFormatter())
    ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", alpha=0.15)


def _positive(values: np.ndarray) -> np.ndarray:
    """The values with zeros and negatives masked as nan, which a log axis cannot show."""
    return np.where(values > 0, values, np.nan)
