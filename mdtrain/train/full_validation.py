"""Full validation (the ``validating`` section): every frame of every validation system, at
``validation_freq``, with the best checkpoints kept by ``validation_metric``, as DeePMD-kit
3.2 does it (``deepmd/pt_expt/train/validation.py``, ``deepmd/utils/eval_metrics.py``).

Metrics, each a mean over all values of all systems (systems weighted by their number of
values): ``E`` the energy error per atom (one value per frame), ``F`` the force components,
``V`` the virial per atom (9 per frame) and ``S`` the stress, minus the virial over the cell
volume (9 per frame); ``V`` and ``S`` only on periodic frames. Each as MAE and RMSE.

The run at display step ``s`` happens when ``s >= start`` and ``(s - start) %
validation_freq == 0``, with ``start`` from ``full_val_start`` (0 ≤ x < 1: that fraction of
the steps; 1: never; larger: that step). Each rank evaluates every ``world``-th frame; the sums
are added over ranks, so every rank takes the same decision. The ``max_best_ckpt`` best
(metric, step) records are kept (ties: the earlier step); a new member is saved as
``best.ckpt-<step>.t-<rank>.pt`` and the files renamed to their ranks. The records travel in
the checkpoints, so a restart continues the ranking. ``val.log`` has DeePMD-kit's layout:
a header, one row per validation (5 significant digits, meV units), a comment line per save.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import re
from collections.abc import Callable

import numpy as np
import torch

from mdtrain.errors import MDTrainError

log = logging.getLogger("mdtrain")

QUANTITIES = ("e", "f", "s", "v")  # rows of the sums: [sum |d|, sum d², count]
UNITS = {"e": "meV/atom", "f": "meV/Å", "s": "meV/Å³", "v": "meV/atom"}
DIGITS = 5


def start_step(full_val_start: float, numb_steps: int) -> int | None:
    """The first display step of full validation; None: never."""
    value = float(full_val_start)
    if value == 1.0:
        return None
    return int(numb_steps * value) if 0.0 <= value < 1.0 else int(value)


def frame_errors(pred: dict, labels: dict, natoms: int, box: torch.Tensor | None) -> torch.Tensor:
    """(4, 3) float64 sums [|d|, d², count] of E, F, S, V for one batch of frames."""
    sums = torch.zeros(len(QUANTITIES), 3, dtype=torch.float64)

    def add(q: str, diff: torch.Tensor) -> None:
        d = diff.detach().to("cpu", torch.float64)
        sums[QUANTITIES.index(q)] += torch.stack(
            [d.abs().sum(), d.square().sum(), d.new_tensor(d.numel())]
        )

    if "energy" in labels:
        add("e", (pred["energy"] - labels["energy"].to(pred["energy"].dtype)) / natoms)
    if "force" in labels:
        add("f", pred["force"] - labels["force"].to(pred["force"].dtype))
    if "virial" in labels and box is not None:
        diff = (pred["virial"] - labels["virial"].to(pred["virial"].dtype)).reshape(-1, 9)
        add("v", diff / natoms)
        volume = torch.linalg.det(box.to(torch.float64)).abs().to(diff.device)
        keep = volume > 0
        add("s", -diff[keep] / volume[keep, None].to(diff.dtype))
    return sums


def metrics_of(sums: torch.Tensor) -> dict[str, float]:
    """``{"e:mae": .., "e:rmse": .., ...}`` in eV units; NaN where nothing was counted."""
    out = {}
    for q, (absolute, square, count) in zip(QUANTITIES, sums.tolist(), strict=True):
        out[f"{q}:mae"] = absolute / count if count else math.nan
        out[f"{q}:rmse"] = math.sqrt(square / count) if count else math.nan
    return out


def format_number(value: float) -> str:
    """A value with 5 significant digits, in fixed notation where it fits (as DeePMD-kit)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0.0 or abs(value) < np.finfo(float).tiny:
        return "0"
    decimals = DIGITS - int(math.floor(math.log10(abs(value)))) - 1
    if decimals > 16:
        return f"{value:.{DIGITS - 1}e}"
    rounded = round(value, decimals) + 0.0
    return f"{rounded:.{decimals}f}" if decimals > 0 else f"{rounded:.0f}"


class FullValidator:
    """One flow of full validation (the live weights, or the averaged ones)."""

    def __init__(
        self,
        section: dict,
        numb_steps: int,
        log_path: str,
        best_dir: str,
        best_prefix: str,
        records: list | None,
        restart: bool,
        is_main: bool,
    ) -> None:
        self.freq = int(section.get("validation_freq", 5000))
        self.save_best = bool(section.get("save_best", True))
        self.max_best = int(section.get("max_best_ckpt", 1))
        self.metric = str(section.get("validation_metric", "E:MAE")).strip().lower()
        self.start = start_step(section.get("full_val_start", 0.5), numb_steps)
        self.width = max(4, len(str(numb_steps)))
        second = "v" if self.metric.startswith("v") else "s"
        self.columns = [f"{q}:{k}" for q in ("e", "f", second) for k in ("mae", "rmse")]
        self.log_path, self.best_dir, self.best_prefix = log_path, best_dir, best_prefix
        self.pattern = re.compile(re.escape(best_prefix) + r"-(\d+)\.t-(\d+)\.pt")
        self.records = sorted((float(m), int(s)) for m, s in records or [])[: self.max_best]
        self.is_main = is_main
        self._header = not (restart and os.path.exists(log_path))
        if is_main:
            os.makedirs(best_dir, exist_ok=True)
            if not (restart and self.records):
                self._set_aside_old()

    def due(self, step: int) -> bool:
        return (
            self.start is not None and step >= self.start and (step - self.start) % self.freq == 0
        )

    def state(self) -> dict:
        """What a checkpoint keeps of this flow."""
        return {"metric": self.metric, "records": [[m, s] for m, s in self.records]}

    def run(self, step: int, sums: torch.Tensor, save: Callable[[str], None]) -> None:
        """Rank the metrics of ``sums`` (summed over every rank), save a new best checkpoint
        with ``save(path)`` (rank 0) and write the log row."""
        metrics = metrics_of(sums)
        value = metrics[self.metric]
        if math.isnan(value):
            raise MDTrainError(
                f"validating.validation_metric {self.metric.upper()}: the validation systems "
                f"have no {self._label_name()} to compute it from"
            )
        kept = sorted([r for r in self.records if r[1] != step] + [(value, step)])[: self.max_best]
        saved = None
        if (value, step) in kept:
            self.records = kept
            if self.save_best:
                saved = self._path(step, kept.index((value, step)) + 1)
        if self.is_main:
            if saved is not None:
                save(saved)
                self._reconcile()
            self._write(step, metrics, saved, value)

    def _label_name(self) -> str:
        return {"e": "energy labels", "f": "force labels"}.get(
            self.metric[0], "virial labels on periodic frames"
        )

    def _path(self, step: int, rank: int) -> str:
        return os.path.join(self.best_dir, f"{self.best_prefix}-{step}.t-{rank}.pt")

    def _files(self) -> list[tuple[int, str]]:
        found = []
        for path in glob.glob(os.path.join(glob.escape(self.best_dir), f"{self.best_prefix}-*.pt")):
            m = self.pattern.fullmatch(os.path.basename(path))
            if m and not os.path.islink(path):
                found.append((int(m.group(1)), path))
        return found

    def _reconcile(self) -> None:
        """The kept records' files renamed to their ranks; the others removed."""
        wanted = {s: self._path(s, k) for k, (_, s) in enumerate(self.records, start=1)}
        moves = []
        for step, path in self._files():
            if step not in wanted:
                os.unlink(path)
            elif path != wanted[step]:
                os.replace(path, path + ".tmp")
                moves.append((path + ".tmp", wanted[step]))
        for tmp, final in moves:
            os.replace(tmp, final)

    def _set_aside_old(self) -> None:
        """Best checkpoints of an earlier run in the same place: renamed, never deleted."""
        for _, path in self._files():
            os.replace(path, path + ".superseded")
            log.warning("best checkpoint %s of an earlier run renamed to *.superseded", path)

    def _write(self, step: int, metrics: dict, saved: str | None, value: float) -> None:
        labels = [f"{c.replace(':', '_').upper()}({UNITS[c[0]]})" for c in self.columns]
        widths = [max(len(label), 10) for label in labels]
        with open(self.log_path, "w" if self._header else "a", encoding="utf-8") as out:
            if self._header:
                head = "# " + f"{'step':^{self.width}s}"
                head += "".join(f" {label:^{w}s}" for label, w in zip(labels, widths, strict=True))
                out.write(head + "\n")
                out.write(
                    "# E: energy error per atom; F: force components; the second-rank column "
                    "is S (stress, minus the virial over the cell volume) or V (virial per "
                    "atom), as validation_metric picks\n"
                )
                self._header = False
            row = "  " + f"{step:^{self.width}d}"
            for column, w in zip(self.columns, widths, strict=True):
                row += f" {format_number(metrics[column] * 1000.0):^{w}s}"
            out.write(row + "\n")
            if saved is not None:
                shown = f"{self.metric.upper()} = {format_number(value * 1000.0)} {UNITS[self.metric[0]]}"
                out.write(f"# saved best checkpoint: {saved} ({shown})\n")
                log.info("saved best checkpoint %s (%s)", saved, shown)
