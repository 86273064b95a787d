"""The ``tensor`` loss (DeePMD-kit's ``loss.type = "tensor"``, ``deepmd/pt/loss/tensor.py``)
of dipole and polarizability models, for a batch of ``nf`` frames of one system of ``N``
atoms and a tensor of ``k`` values (3 or 9)::

    L = pref_atomic * mean((T_i - T_i^label)^2)   over nf * N * k values (atomic_<label>.npy)
      + pref        * mean((T - T^label)^2)       over nf * k values (<label>.npy)

with constant prefactors (no learning-rate schedule). A term is on when its prefactor is
positive and the batch has its label. Displayed errors, DeePMD-kit's names:
``rmse_local_<name>`` = sqrt of the atomic mean, ``rmse_global_<name>`` = sqrt of the
global mean divided by N (``<name>`` is ``dipole`` or ``polar``). Both terms are means over
frames, so micro-batches weighted by their share of frames add up to the full batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from mdtrain.errors import MDTrainError

# label name (files, model outputs) -> DeePMD-kit's tensor name in the displayed errors
TENSOR_NAMES = {"dipole": "dipole", "polarizability": "polar"}


class TensorLoss:
    """Weighted squared errors of atomic and global tensors."""

    def __init__(self, label: str, pref: float, pref_atomic: float) -> None:
        if label not in TENSOR_NAMES:
            raise MDTrainError(f"loss: no tensor loss for {label!r}")
        if pref < 0 or pref_atomic < 0:
            raise MDTrainError(
                f"loss.pref and loss.pref_atomic must be >= 0, got {pref} and {pref_atomic}"
            )
        if pref == 0 and pref_atomic == 0:
            raise MDTrainError("loss.pref and loss.pref_atomic: at least one must be > 0")
        self.label = label
        self.name = TENSOR_NAMES[label]
        self.pref = float(pref)
        self.pref_atomic = float(pref_atomic)

    @classmethod
    def from_config(cls, loss: Mapping, label: str) -> TensorLoss:
        """From the ``loss`` section (``pref``, ``pref_atomic``: required, as in DeePMD-kit)."""
        for key in ("pref", "pref_atomic"):
            value = loss.get(key)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise MDTrainError(f"loss.{key}: a number is required for the tensor loss")
        if loss.get("enable_atomic_weight"):
            raise MDTrainError("loss.enable_atomic_weight: not supported by mdtrain")
        return cls(label, float(loss["pref"]), float(loss["pref_atomic"]))

    def label_files(self) -> list[str]:
        """The label files the terms that are on read (a system needs one of them)."""
        files = [f"atomic_{self.label}"] if self.pref_atomic > 0 else []
        return files + ([self.label] if self.pref > 0 else [])

    def metric_keys(self) -> list[str]:
        """Metric names reported every step (sorted, as written to lcurve.out)."""
        keys = ["rmse"]
        if self.pref_atomic > 0:
            keys.append(f"rmse_local_{self.name}")
        if self.pref > 0:
            keys.append(f"rmse_global_{self.name}")
        return sorted(keys)

    def loss_metric_keys(self) -> list[str]:
        """Metrics a validation takes from this loss (all but ``rmse``)."""
        return [k for k in self.metric_keys() if k != "rmse"]

    def __call__(
        self,
        pred: Mapping[str, torch.Tensor],
        label: Mapping[str, torch.Tensor],
        natoms: int,
        lr: float = 0.0,
        weight: float = 1.0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of a (micro-)batch and its metrics (NaN for a label the batch lacks).

        ``pred``: ``atom_<label>`` (nf, N, k) and ``<label>`` (nf, k); ``label``:
        ``atomic_<label>`` (nf, N, k) and ``<label>`` (nf, k), each absent when the system
        lacks it. ``lr`` is unused (constant prefactors)."""
        del lr
        atomic_pred, total_pred = pred[f"atom_{self.label}"], pred[self.label]
        loss = total_pred.new_zeros(())
        metrics: dict[str, torch.Tensor] = {}
        nan = total_pred.new_full((), math.nan)
        used = False
        if self.pref_atomic > 0:
            key = f"atomic_{self.label}"
            if key in label:
                diff = atomic_pred - label[key].to(atomic_pred.dtype).reshape(atomic_pred.shape)
                mse = diff.square().mean()
                loss = loss + self.pref_atomic * mse
                metrics[f"rmse_local_{self.name}"] = mse.detach().sqrt()
                used = True
            else:
                metrics[f"rmse_local_{self.name}"] = nan
        if self.pref > 0:
            if self.label in label:
                diff = total_pred - label[self.label].to(total_pred.dtype).reshape(total_pred.shape)
                mse = diff.square().mean()
                loss = loss + self.pref * mse
                metrics[f"rmse_global_{self.name}"] = mse.detach().sqrt() / natoms
                used = True
            else:
                metrics[f"rmse_global_{self.name}"] = nan
        if not used:  # keep the graph connected so backward() works; gradients are zero
            loss = loss + 0.0 * total_pred.sum()
        metrics["rmse"] = loss.detach().sqrt()
        return loss * weight, metrics
