"""The ``property`` loss (DeePMD-kit's ``loss.type = "property"``, ``deepmd/pt/loss/
property.py``) of property models, for a batch of ``nf`` frames of one system of ``N`` atoms
and a property of ``k = task_dim`` values. With ``p``, ``y`` the predicted and labelled frame
properties, divided by ``N`` unless the property is ``intensive``, and ``b``, ``s`` the
model's output bias and standard deviation of type 0 (``out_bias[0]``, ``out_std[0]``)::

    smooth_mae: sum over nf * k of huber_beta((y - b)/s - (p - b)/s)   (torch's smooth_l1)
    mae:        sum |(y - p)/s|        mse: sum ((y - p)/s)^2
    rmse:       sqrt(mean ((y - p)/s)^2)
    mape:       mean |(y - p) / (y + 0.001)|

Displayed errors (``metric``), on ``p`` and ``y`` themselves: ``smooth_mae``, ``mae``,
``mse``, ``rmse``, ``mape``, means over nf * k. The sums are not means over frames: a
micro-batch contributes its own sum (unweighted), so micro-batches add up to the full batch
exactly; ``mape`` is weighted like the other losses' means.

Over ranks (``ranks`` > 1): the trainer averages the ranks' gradients, which suits a mean over
frames but would halve a sum over the global batch on 2 ranks. So a summed loss is the rank's
sum times ``ranks``, and the averaged gradient is that of the sum over the global batch: one
rank with batch 2b and two with b each take the same step (DeePMD-kit's DDP averages the
ranks' own sums, so its step shrinks with the number of ranks; docs/deepmd-differences.md).
``mape`` is a mean and needs no factor.

``rmse`` is the root of a mean over the whole global batch, ``sqrt(M)``, ``M = S / G`` with
``S`` the sum of squares over every rank's frames and ``G`` their count: not a sum of
micro-batch or rank terms. The trainer therefore gives it ``(S, G)`` before the step
(`set_batch_sums`: a pass without gradients over the batch, one all_reduce; see
``batch_sums.py``), and each micro-batch then backpropagates its own sum of squares ``s``
times ``ranks / (2 sqrt(M) G)``, which over micro-batches and the ranks' average is exactly
``d sqrt(M)`` (its value is its share ``sqrt(M) s / S`` of the loss). Called without the
sums (validation, a single batch) it is the batch's own root.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from mdtrain.errors import MDTrainError

LOSS_FUNCS = ("smooth_mae", "mae", "mse", "rmse", "mape")
_SUMMED = ("smooth_mae", "mae", "mse")


class PropertyLoss:
    """DeePMD-kit's property loss of one named property."""

    def __init__(
        self,
        label: str,
        intensive: bool,
        stats: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        loss_func: str = "smooth_mae",
        metric: list[str] | None = None,
        beta: float = 1.0,
        ranks: int = 1,
    ) -> None:
        """``stats()``: the model's ``(out_bias[0], out_std[0])`` at the time of the call;
        ``ranks``: the training's world size (a summed loss is scaled by it)."""
        if loss_func not in LOSS_FUNCS:
            raise MDTrainError(f"loss.loss_func: {loss_func!r} is not one of {LOSS_FUNCS}")
        metric = ["mae"] if metric is None else list(metric)
        for name in metric:
            if name not in LOSS_FUNCS:
                raise MDTrainError(f"loss.metric: {name!r} is not one of {LOSS_FUNCS}")
        if not beta > 0:
            raise MDTrainError(f"loss.beta: {beta!r} must be > 0")
        self.label, self.intensive, self.stats = label, bool(intensive), stats
        self.loss_func, self.metric, self.beta = loss_func, metric, float(beta)
        self.ranks = int(ranks)
        self.sums: torch.Tensor | None = None  # the global batch's (S, G) during a step

    @property
    def needs_batch_sums(self) -> bool:
        """Whether the loss is a function of sums over the whole global batch (``rmse``)."""
        return self.loss_func == "rmse"

    def batch_sums(
        self, pred: Mapping[str, torch.Tensor], label: Mapping[str, torch.Tensor], natoms: int
    ) -> torch.Tensor:
        """``(S, G)`` of some frames, float64 without gradient: the sum of the squared
        normalised errors and their count (frames × task_dim)."""
        a, b = self._normalised(pred, label, natoms)[:2]
        d = (a - b).detach().to(torch.float64)
        total = d.square().sum()
        return torch.stack([total, torch.full_like(total, float(d.numel()))])

    def set_batch_sums(self, sums: torch.Tensor | None) -> None:
        """The global batch's ``(S, G)`` for the coming step's micro-batches (None after)."""
        self.sums = sums

    @classmethod
    def from_config(cls, loss: Mapping, model: torch.nn.Module, ranks: int = 1) -> PropertyLoss:
        """From the ``loss`` section and the property ``model`` (its name, ``intensive`` and
        output statistics), trained on ``ranks`` ranks."""
        return cls(
            model.output,
            model.intensive,
            lambda: (model.out_bias[0], model.out_std[0]),
            loss.get("loss_func", "smooth_mae"),
            loss.get("metric", ["mae"]),
            float(loss.get("beta", 1.0)),
            ranks,
        )

    def metric_keys(self) -> list[str]:
        """Metric names reported every step (sorted, as written to lcurve.out); ``rmse`` is
        the property's RMSE when ``metric`` names it, else the root of the loss."""
        return sorted({"rmse", *self.metric})

    def loss_metric_keys(self) -> list[str]:
        """Metrics a validation takes from this loss."""
        return [k for k in self.metric_keys() if k != "rmse" or "rmse" in self.metric]

    def __call__(
        self,
        pred: Mapping[str, torch.Tensor],
        label: Mapping[str, torch.Tensor],
        natoms: int,
        lr: float = 0.0,
        weight: float = 1.0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of a (micro-)batch and its metrics. ``pred[<name>]`` (nf, k); ``label`` holds
        ``<name>`` (every system has it: `label_problems`). ``lr`` is unused."""
        del lr
        a, b, p, y = self._normalised(pred, label, natoms)
        func = self.loss_func
        if func == "smooth_mae":
            loss = F.smooth_l1_loss(a, b, reduction="sum", beta=self.beta) * self.ranks
        elif func == "mae":
            loss = F.l1_loss(a, b, reduction="sum") * self.ranks
        elif func == "mse":
            loss = F.mse_loss(a, b, reduction="sum") * self.ranks
        elif func == "rmse" and self.sums is not None:
            loss = self._global_root(a, b)
        elif func == "rmse":
            loss = F.mse_loss(a, b, reduction="mean").sqrt() * weight
        else:
            loss = ((y - p) / (y + 1e-3)).abs().mean()
        metrics = {name: self._metric(name, y, p.detach()) for name in self.metric}
        if "rmse" not in metrics:
            # merge_metrics adds weight * rmse^2 over micro-batches: a sum's share is loss/weight
            if func in _SUMMED:
                share = loss.detach() / weight
            elif func == "rmse":  # the batch's root: the global one while sums are set
                share = self._root() if self.sums is not None else loss.detach() / weight
            else:
                share = loss.detach()
            metrics["rmse"] = share.sqrt()
        return loss if func != "mape" else loss * weight, metrics

    def _normalised(
        self, pred: Mapping[str, torch.Tensor], label: Mapping[str, torch.Tensor], natoms: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(y - b)/s``, ``(p - b)/s``, ``p`` and ``y`` (per atom unless intensive)."""
        p = pred[self.label]
        y = label[self.label].to(p.dtype).reshape(p.shape)
        if not self.intensive:
            p, y = p / natoms, y / natoms
        bias, std = (t.to(p.dtype) for t in self.stats())
        return (y - bias) / std, (p - bias) / std, p, y

    def _root(self) -> torch.Tensor:
        """``sqrt(M)`` of the global batch."""
        assert self.sums is not None
        return (self.sums[0] / self.sums[1]).sqrt()

    def _global_root(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part of ``sqrt(M)``: value ``sqrt(M) s / S``, gradient
        ``ranks ds / (2 sqrt(M) G)`` (zero at a perfect fit, where the root has none)."""
        assert self.sums is not None
        total, count = (v.to(a.dtype) for v in self.sums)
        s = (a - b).square().sum()
        root = (total / count).sqrt()
        value = root * s.detach() / total if total > 0 else s.detach() * 0
        slope = self.ranks / (2 * root * count) if total > 0 else 0.0
        return value + (s - s.detach()) * slope

    def _metric(self, name: str, y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if name == "smooth_mae":
            return F.smooth_l1_loss(y, p, reduction="mean", beta=self.beta)
        if name == "mae":
            return F.l1_loss(y, p, reduction="mean")
        if name == "mse":
            return F.mse_loss(y, p, reduction="mean")
        if name == "rmse":
            return F.mse_loss(y, p, reduction="mean").sqrt()
        return ((y - p) / (y + 1e-3)).abs().mean()
