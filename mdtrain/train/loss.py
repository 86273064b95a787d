"""Energy/force/virial loss (DeePMD-compatible ``loss.type = "ener"``) and error accumulators.

Loss of one batch of ``nf`` frames of one system with ``N`` atoms, at learning rate ``lr``::

    pref_x = limit_pref_x + (start_pref_x - limit_pref_x) * lr / start_lr
    L = pref_e * mean_f(dE^2) / N            # legacy per-atom normalisation, applied once
      + pref_f * mean(dF^2)                  # over all nf*N*3 components
      + pref_v * mean_f(mean_9(dV^2)) / N

A term is active when both of its prefactors (start and limit) are non-zero **and** the batch
carries the label (the label dict has the key): the rule of DeePMD-kit's PyTorch backend (its
TensorFlow backend takes either), so ``start_pref_v = 0, limit_pref_v = 1`` trains no virial. Every term is a mean over frames (the force MSE equals the
mean over frames of per-frame means because all frames of a batch have the same N), so a batch
split into micro-batches gives exactly the full-batch loss when each micro-batch is called with
``weight = micro_nf / full_nf`` and the results are summed; `merge_metrics` combines their
metrics exactly in the same way.

`ErrorAccumulator` keeps sums (not averages) of squared and absolute errors with their counts,
so validation and ``mdtrain test`` can merge batches, systems and ranks exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from mdtrain.errors import MDTrainError

TERMS = ("energy", "force", "virial")
_METRIC = {"energy": "rmse_e", "force": "rmse_f", "virial": "rmse_v"}


class EnergyLoss:
    """Weighted MSE of energy, forces and virial with learning-rate-dependent prefactors."""

    def __init__(
        self,
        start_pref_e: float,
        limit_pref_e: float,
        start_pref_f: float,
        limit_pref_f: float,
        start_pref_v: float,
        limit_pref_v: float,
        start_lr: float,
    ) -> None:
        if not start_lr > 0:
            raise MDTrainError(f"learning_rate.start_lr must be > 0, got {start_lr}")
        self.start_lr = float(start_lr)
        self.prefs = {
            "energy": (float(start_pref_e), float(limit_pref_e)),
            "force": (float(start_pref_f), float(limit_pref_f)),
            "virial": (float(start_pref_v), float(limit_pref_v)),
        }
        for name, (start, limit) in self.prefs.items():
            if start < 0 or limit < 0:
                key = name[0]
                raise MDTrainError(
                    f"loss.start_pref_{key} and loss.limit_pref_{key} must be >= 0, "
                    f"got {start} and {limit}"
                )

    @classmethod
    def from_config(cls, loss: Mapping, start_lr: float) -> EnergyLoss:
        """Build from the ``loss`` section of the input (keys ``start_pref_e`` ... )."""
        keys = [f"{w}_pref_{x}" for x in "efv" for w in ("start", "limit")]
        return cls(*(float(loss[k]) for k in keys), start_lr=start_lr)

    def configured_terms(self) -> list[str]:
        """Terms whose two prefactors are both non-zero (independent of which labels a system
        has); as in DeePMD-kit's PyTorch backend, one zero prefactor switches a term off."""
        return [t for t, (s, lim) in self.prefs.items() if s != 0 and lim != 0]

    def active_terms(self, labels: Iterable[str]) -> list[str]:
        """Terms that contribute for a system carrying ``labels``; empty means nothing to fit."""
        have = set(labels)
        return [t for t in self.configured_terms() if t in have]

    def metric_keys(self) -> list[str]:
        """Metric names reported every step (sorted, as written to lcurve.out)."""
        return ["rmse"] + sorted(_METRIC[t] for t in self.configured_terms())

    def pref(self, term: str, lr: float) -> float:
        """Prefactor of ``term`` at learning rate ``lr``."""
        start, limit = self.prefs[term]
        return limit + (start - limit) * lr / self.start_lr

    def __call__(
        self,
        pred: Mapping[str, torch.Tensor],
        label: Mapping[str, torch.Tensor],
        natoms: int,
        lr: float,
        weight: float = 1.0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of a (micro-)batch and its metrics.

        ``pred``/``label``: ``energy`` (nf,), ``force`` (nf, N, 3), ``virial`` (nf, 3, 3);
        a label is absent when the system lacks it. ``weight`` multiplies the loss (use
        ``micro_nf / full_nf`` for micro-batches); metrics are those of the frames given,
        unweighted, as detached 0-d tensors (NaN for a missing label), so no device sync
        happens here. Returns ``(loss, metrics)`` with metric keys `metric_keys()`.
        """
        ref = pred["energy"]
        loss = ref.new_zeros(())
        metrics: dict[str, torch.Tensor] = {}
        active = False
        for term in self.configured_terms():
            key = _METRIC[term]
            if term not in label:
                metrics[key] = ref.new_full((), math.nan).detach()
                continue
            active = True
            diff = pred[term] - label[term].to(pred[term].dtype)
            if term == "force":
                mse = diff.square().mean()
                loss = loss + self.pref(term, lr) * mse
                metrics[key] = mse.detach().sqrt()
            else:  # energy (nf,) or virial (nf, 3, 3): per frame, then / N once
                per_frame = diff.square().reshape(diff.shape[0], -1).mean(dim=1)
                mse = per_frame.mean()
                loss = loss + self.pref(term, lr) * mse / natoms
                metrics[key] = mse.detach().sqrt() / natoms
        if not active:
            # keep the graph connected so backward() works; gradients are zero
            loss = loss + 0.0 * ref.sum()
        metrics["rmse"] = loss.detach().sqrt()
        return loss * weight, metrics


def one_sided_terms(loss: Mapping) -> list[str]:
    """One warning per term of the ``loss`` section that has exactly one non-zero prefactor:
    it trains nothing here (and in DeePMD-kit's PyTorch backend), though DeePMD-kit's
    TensorFlow backend would train it, so an input from there may expect it."""
    out = []
    for term in TERMS:
        key = term[0]
        start = float(loss.get(f"start_pref_{key}", 0.0))
        limit = float(loss.get(f"limit_pref_{key}", 0.0))
        if (start != 0) != (limit != 0):
            out.append(
                f"loss: start_pref_{key} is {start:g} and limit_pref_{key} {limit:g}, so the "
                f"{term} term is off (a term trains only when both prefactors are non-zero, "
                "as in DeePMD-kit's PyTorch backend)"
            )
    return out


def merge_metrics(
    parts: Sequence[tuple[Mapping[str, torch.Tensor | float], float]],
) -> dict[str, float]:
    """Combine metrics of micro-batches ``[(metrics, weight), ...]`` into full-batch values.

    Every metric is the square root of a mean over frames, so the full-batch value is
    ``sqrt(sum_i weight_i * metric_i**2)`` with ``weight_i = micro_nf / full_nf``.
    """
    out: dict[str, float] = {}
    for key in parts[0][0]:
        total = sum(w * float(m[key]) ** 2 for m, w in parts)
        out[key] = math.sqrt(total)
    return out


class ErrorAccumulator:
    """Sums of squared and absolute errors with counts, mergeable across batches and ranks.

    Quantities: ``loss`` (per-frame loss, fed by the caller), ``e`` (energy per atom,
    dE/N, one value per frame), ``f`` (force components), ``v`` (virial per atom, dV/N,
    9 per frame). Stored as a float64 tensor of shape (4, 3): [sum sq, sum abs, count].
    """

    QUANTITIES = ("loss", "e", "f", "v")

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._sums = torch.zeros(len(self.QUANTITIES), 3, dtype=torch.float64, device=device)

    def _add(self, q: str, err: torch.Tensor) -> None:
        row = self.QUANTITIES.index(q)
        err = err.detach().to(self._sums.device, torch.float64)
        self._sums[row, 0] += err.square().sum()
        self._sums[row, 1] += err.abs().sum()
        self._sums[row, 2] += err.numel()

    def add(
        self,
        pred: Mapping[str, torch.Tensor],
        label: Mapping[str, torch.Tensor],
        natoms: int,
        loss: torch.Tensor | float | None = None,
    ) -> None:
        """Add one batch of frames of one system; labels absent from ``label`` are skipped.

        ``loss`` (the batch loss, a mean over its frames) is counted once per frame, so
        `rmse()["rmse"]` is the frame-weighted root of the mean loss.
        """
        nf = pred["energy"].shape[0]
        if "energy" in label:
            self._add("e", (pred["energy"] - label["energy"].to(pred["energy"].dtype)) / natoms)
        if "force" in label:
            self._add("f", pred["force"] - label["force"].to(pred["force"].dtype))
        if "virial" in label:
            self._add("v", (pred["virial"] - label["virial"].to(pred["virial"].dtype)) / natoms)
        if loss is not None:
            row = self.QUANTITIES.index("loss")
            loss_t = torch.as_tensor(loss).detach().to(self._sums.device, torch.float64)
            self._sums[row, 0] += loss_t * nf
            self._sums[row, 2] += nf

    def merge(self, other: ErrorAccumulator) -> None:
        """Add another accumulator's sums into this one."""
        self._sums += other._sums.to(self._sums.device)

    def to_tensor(self) -> torch.Tensor:
        """The raw sums (a copy), e.g. for ``torch.distributed.all_reduce(op=SUM)``."""
        return self._sums.clone()

    @classmethod
    def from_tensor(cls, sums: torch.Tensor) -> ErrorAccumulator:
        """Rebuild from `to_tensor` output (after an all-reduce)."""
        acc = cls(device=sums.device)
        acc._sums = sums.detach().to(torch.float64).reshape(len(cls.QUANTITIES), 3).clone()
        return acc

    def count(self, q: str) -> int:
        """Number of values accumulated for quantity ``q`` (frames for e/loss)."""
        return int(self._sums[self.QUANTITIES.index(q), 2])

    def rmse(self) -> dict[str, float]:
        """``rmse`` (sqrt of mean loss), ``rmse_e`` (eV/atom), ``rmse_f``, ``rmse_v``; NaN if empty."""
        s = self._sums.cpu().tolist()
        names = ("rmse", "rmse_e", "rmse_f", "rmse_v")
        return {
            n: math.sqrt(r[0] / r[2]) if r[2] else math.nan for n, r in zip(names, s, strict=True)
        }

    def mae(self) -> dict[str, float]:
        """``mae_e`` (eV/atom), ``mae_f``, ``mae_v``; NaN if empty."""
        s = self._sums.cpu().tolist()[1:]
        names = ("mae_e", "mae_f", "mae_v")
        return {n: r[1] / r[2] if r[2] else math.nan for n, r in zip(names, s, strict=True)}
