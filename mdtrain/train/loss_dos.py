"""The ``dos`` loss (DeePMD-kit's ``loss.type = "dos"``, ``deepmd/pt/loss/dos.py``) of DOS
models, for a batch of ``nf`` frames of one system of ``N`` atoms and ``k = numb_dos``::

    pref_x = limit_pref_x + (start_pref_x - limit_pref_x) * lr / start_lr
    L = pref_ados * mean((d_i - d_i^label)^2)              over nf * N * k (atom_dos.npy)
      + pref_acdf * mean((cumsum_k d_i - cumsum_k d_i^label)^2)
      + pref_dos  * mean((d - d^label)^2)                  over nf * k     (dos.npy)
      + pref_cdf  * mean((cumsum_k d - cumsum_k d^label)^2)

A term is on when both of its prefactors are non-zero, and counts for a batch whose system has
its label. Displayed errors, DeePMD-kit's names: ``rmse_local_dos``, ``rmse_local_cdf`` (the
roots of the atomic means), ``rmse_global_dos``, ``rmse_global_cdf`` (the roots of the frame
means divided by N). Every term is a mean over frames, so micro-batches weighted by their
share of frames add up to the full batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from mdtrain.errors import MDTrainError

# term -> (metric name, label file, cumulative)
TERMS = {
    "ados": ("rmse_local_dos", "atom_dos", False),
    "acdf": ("rmse_local_cdf", "atom_dos", True),
    "dos": ("rmse_global_dos", "dos", False),
    "cdf": ("rmse_global_cdf", "dos", True),
}
DEFAULTS = {"dos": 0.0, "cdf": 0.0, "ados": 1.0, "acdf": 0.0}  # DeePMD-kit's argcheck


class DOSLoss:
    """Weighted squared errors of the frame and atomic DOS and their cumulative sums."""

    def __init__(self, prefs: Mapping[str, tuple[float, float]], start_lr: float) -> None:
        if not start_lr > 0:
            raise MDTrainError(f"learning_rate.start_lr must be > 0, got {start_lr}")
        self.start_lr = float(start_lr)
        self.prefs = {t: (float(prefs[t][0]), float(prefs[t][1])) for t in TERMS}
        for term, (start, limit) in self.prefs.items():
            if start < 0 or limit < 0:
                raise MDTrainError(
                    f"loss.start_pref_{term} and loss.limit_pref_{term} must be >= 0, "
                    f"got {start} and {limit}"
                )
        self.terms = [t for t, (s, lim) in self.prefs.items() if s != 0 and lim != 0]
        if not self.terms:
            raise MDTrainError("loss: no term of the dos loss has both prefactors non-zero")

    @classmethod
    def from_config(cls, loss: Mapping, start_lr: float) -> DOSLoss:
        """From the ``loss`` section (``start_pref_dos`` ... ``limit_pref_acdf``)."""
        prefs = {
            t: (loss.get(f"start_pref_{t}", d), loss.get(f"limit_pref_{t}", d))
            for t, d in DEFAULTS.items()
        }
        return cls(prefs, start_lr)

    def pref(self, term: str, lr: float) -> float:
        start, limit = self.prefs[term]
        return limit + (start - limit) * lr / self.start_lr

    def metric_keys(self) -> list[str]:
        """Metric names reported every step (sorted, as written to lcurve.out)."""
        return sorted(["rmse", *(TERMS[t][0] for t in self.terms)])

    def loss_metric_keys(self) -> list[str]:
        """Metrics a validation takes from this loss (all but ``rmse``)."""
        return [k for k in self.metric_keys() if k != "rmse"]

    def __call__(
        self,
        pred: Mapping[str, torch.Tensor],
        label: Mapping[str, torch.Tensor],
        natoms: int,
        lr: float,
        weight: float = 1.0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of a (micro-)batch and its metrics (NaN for a label the batch lacks).

        ``pred``: ``atom_dos`` (nf, N, k) and ``dos`` (nf, k); ``label``: the same names, each
        absent when the system lacks it."""
        total = pred["dos"]
        loss = total.new_zeros(())
        metrics: dict[str, torch.Tensor] = {}
        used = False
        for term in self.terms:
            name, key, cumulative = TERMS[term]
            if key not in label:
                metrics[name] = total.new_full((), math.nan)
                continue
            out = pred[key]
            diff = out - label[key].to(out.dtype).reshape(out.shape)
            if cumulative:
                diff = torch.cumsum(diff, dim=-1)
            mse = diff.square().mean()
            loss = loss + self.pref(term, lr) * mse
            shown = mse.detach().sqrt()
            metrics[name] = shown if key == "atom_dos" else shown / natoms
            used = True
        if not used:  # keep the graph connected so backward() works; gradients are zero
            loss = loss + 0.0 * total.sum()
        metrics["rmse"] = loss.detach().sqrt()
        return loss * weight, metrics
