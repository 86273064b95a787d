"""The ``ener`` loss (DeePMD-kit's ``loss.type = "ener"``) and error accumulators.

Loss of one batch of ``nf`` frames of one system with ``N`` atoms, at learning rate ``lr``,
by default (``loss_func: "mse"``, no options)::

    pref_x = limit_pref_x + (start_pref_x - limit_pref_x) * lr / start_lr
    L = pref_e * mean_f(dE^2) / N            # legacy per-atom normalisation, applied once
      + pref_f * mean(dF^2)                  # over all nf*N*3 components
      + pref_v * mean_f(mean_9(dV^2)) / N

and the atomic-energy, weighted-force and generalized-force terms, Huber, MAE and the other
options of DeePMD-kit 3.2 as `mdtrain.train.loss_terms` writes them. A term is active when
both of its prefactors (start and limit) are non-zero **and** the batch carries its labels:
the rule of DeePMD-kit's PyTorch backend (its TensorFlow backend takes either), so
``start_pref_v = 0, limit_pref_v = 1`` trains no virial. Every term is a mean over frames
(all frames of a batch have the same N), so a batch split into micro-batches gives exactly
the full-batch loss when each micro-batch is called with ``weight = micro_nf / full_nf`` and
the results are summed; `merge_metrics` combines their metrics exactly in the same way.

`ErrorAccumulator` keeps sums (not averages) of squared and absolute errors with their counts,
so validation can merge batches, systems and ranks exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from mdtrain.errors import MDTrainError
from mdtrain.train.loss_dos import DOSLoss
from mdtrain.train.loss_labels import TERM_KEYS, label_problems, one_sided_terms, prefactors
from mdtrain.train.loss_mse import fusable, fused_loss, output_reads
from mdtrain.train.loss_property import PropertyLoss
from mdtrain.train.loss_tensor import TensorLoss
from mdtrain.train.loss_terms import (
    LossOptions,
    atom_energy_term,
    force_diff,
    force_term,
    frame_term,
    generalized_force_term,
    weighted_force_term,
)

__all__ = [
    "DOSLoss",
    "EnergyLoss",
    "PropertyLoss",
    "ErrorAccumulator",
    "TensorLoss",
    "check_labels",
    "label_problems",
    "make_loss",
    "merge_metrics",
    "one_sided_terms",
]

TERMS = tuple(TERM_KEYS)  # energy, force, virial, atom_ener, atom_pref, drdq


class EnergyLoss:
    """Weighted errors of energy, forces, virial and the optional terms (`loss_terms`) with
    learning-rate-dependent prefactors."""

    def __init__(
        self,
        start_pref_e: float,
        limit_pref_e: float,
        start_pref_f: float,
        limit_pref_f: float,
        start_pref_v: float,
        limit_pref_v: float,
        start_lr: float,
        extra_prefs: Mapping[str, tuple[float, float]] | None = None,
        options: LossOptions | None = None,
    ) -> None:
        """``extra_prefs``: ``(start, limit)`` of the ``atom_ener`` (ae), ``atom_pref`` (pf)
        and ``drdq`` (gf) terms (off when absent)."""
        if not start_lr > 0:
            raise MDTrainError(f"learning_rate.start_lr must be > 0, got {start_lr}")
        self.start_lr = float(start_lr)
        self.options = options or LossOptions()
        self.prefs = {
            "energy": (float(start_pref_e), float(limit_pref_e)),
            "force": (float(start_pref_f), float(limit_pref_f)),
            "virial": (float(start_pref_v), float(limit_pref_v)),
        }
        for term in TERMS[3:]:
            start, limit = (extra_prefs or {}).get(term, (0.0, 0.0))
            self.prefs[term] = (float(start), float(limit))
        for name, (start, limit) in self.prefs.items():
            if start < 0 or limit < 0:
                key = TERM_KEYS[name]
                raise MDTrainError(
                    f"loss.start_pref_{key} and loss.limit_pref_{key} must be >= 0, "
                    f"got {start} and {limit}"
                )
        # per set of label names: (term, metric name, contributes) of each configured term
        self._layouts: dict[tuple[str, ...], list[tuple[str, str, bool]]] = {}
        self._fused: dict[tuple[str, ...], bool] = {}  # per set of label names, as _layouts
        if "drdq" in self.configured_terms() and self.options.numb_generalized_coord < 1:
            raise MDTrainError(
                "loss.numb_generalized_coord: must be >= 1 when the gf term is on, got "
                f"{self.options.numb_generalized_coord}"
            )

    @classmethod
    def from_config(cls, loss: Mapping, start_lr: float) -> EnergyLoss:
        """Build from the ``loss`` section of the input (keys ``start_pref_e`` ... )."""
        keys = [f"{w}_pref_{x}" for x in "efv" for w in ("start", "limit")]
        extra = {term: prefactors(loss, term) for term in TERMS[3:]}
        return cls(
            *(float(loss[k]) for k in keys),
            start_lr=start_lr,
            extra_prefs=extra,
            options=LossOptions.from_config(loss),
        )

    def configured_terms(self) -> list[str]:
        """Terms whose two prefactors are both non-zero (independent of which labels a system
        has); as in DeePMD-kit's PyTorch backend, one zero prefactor switches a term off."""
        return [t for t, (s, lim) in self.prefs.items() if s != 0 and lim != 0]

    def active_terms(self, labels: Iterable[str]) -> list[str]:
        """Terms that contribute for a system carrying ``labels``; empty means nothing to fit
        (the ae term needs ``atom_ener``; pf and gf need forces and their own file, which
        `label_problems` makes every system have)."""
        have = set(labels)
        if self.options.use_default_pf:
            have.add("atom_pref")
        need = {"atom_pref": {"force", "atom_pref"}, "drdq": {"force", "drdq"}}
        return [t for t in self.configured_terms() if need.get(t, {t}) <= have]

    def reads(self) -> set[str]:
        """The predictions a training step's loss can read (its configured terms'), so that
        the trainer can tell the model once which outputs a step needs (``train_outputs``)."""
        return output_reads(self.configured_terms(), self.options)

    def metric_name(self, term: str) -> str:
        """DeePMD-kit's name of the error ``term`` displays (``rmse_pf``, ``mae_f``, ...)."""
        kind = "rmse" if term == "drdq" or not self.options.mae else "mae"
        return f"{kind}_{TERM_KEYS[term]}"

    def _layout(self, label: Mapping) -> list[tuple[str, str, bool]]:
        """Each configured term, its metric's name and whether labels with ``label``'s names
        make it contribute: kept per set of names (a system's, the same at every step), as
        the prefactors and options do not change."""
        names = tuple(label)
        layout = self._layouts.get(names)
        if layout is None:
            active = self.active_terms(names)
            layout = [(t, self.metric_name(t), t in active) for t in self.configured_terms()]
            self._layouts[names] = layout
            self._fused[names] = fusable(layout, self.options)  # one node (``loss_mse``)
        return layout

    def metric_keys(self) -> list[str]:
        """Metric names reported every step (sorted, as written to lcurve.out)."""
        return sorted(["rmse", *(self.metric_name(t) for t in self.configured_terms())])

    def loss_metric_keys(self) -> list[str]:
        """Metrics a validation must take from this loss, because `ErrorAccumulator`'s own
        errors (plain energy, force, virial RMSEs) do not measure them."""
        plain = {"rmse_e", "rmse_f", "rmse_v"}
        if self.options.enable_atom_ener_coeff:
            plain.discard("rmse_e")
        if self.options.relative_f is not None:
            plain.discard("rmse_f")
        return [k for k in self.metric_keys() if k != "rmse" and k not in plain]

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

        ``pred``: ``energy`` (nf,), ``atom_energy`` (nf, N), ``force`` (nf, N, 3), ``virial``
        (nf, 3, 3); ``label``: the same names, ``atom_ener``, ``atom_pref``,
        ``atom_ener_coeff`` (nf, N) and ``drdq`` (nf, N, 3 x ncoord), each absent when the
        system lacks it. ``weight`` multiplies the loss (use ``micro_nf / full_nf`` for
        micro-batches); metrics are those of the frames given, unweighted, as detached 0-d
        tensors (NaN for a missing label), so no device sync happens here. Returns
        ``(loss, metrics)`` with metric keys `metric_keys()`.
        """
        ref = pred["energy"]
        loss: torch.Tensor | None = None
        metrics: dict[str, torch.Tensor] = {}
        layout = self._layout(label)
        if self._fused.get(tuple(label)) and pred["force"].dtype == ref.dtype:
            return fused_loss(self, layout, pred, label, natoms, lr, weight)
        for term, key, contributes in layout:
            if not contributes:
                metrics[key] = ref.new_full((), math.nan).detach()
                continue
            value, metrics[key] = self._term(term, pred, label, natoms, self.pref(term, lr))
            if loss is None and value.dtype == ref.dtype:
                loss = value  # 0 + x is x (no term is < 0): one operation and node less
            else:  # the sum in the energy's dtype, as ever
                loss = (ref.new_zeros(()) if loss is None else loss) + value
        if loss is None:
            # keep the graph connected so backward() works; gradients are zero
            loss = ref.new_zeros(()) + 0.0 * ref.sum()
        metrics["rmse"] = loss.detach().sqrt()
        # x * 1.0 is x, and so is its gradient: the whole batch's loss skips the product
        return (loss if weight == 1.0 else loss * weight), metrics

    def _term(
        self, term: str, pred: Mapping, label: Mapping, natoms: int, pref: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One term's ``(pref x value, displayed error)``."""
        opts = self.options

        def labelled(name: str, like: torch.Tensor) -> torch.Tensor:
            return label[name].to(like.dtype)

        if term == "energy":
            energy = pred["energy"]
            if opts.enable_atom_ener_coeff and "atom_ener_coeff" in label:
                atom = pred["atom_energy"]
                energy = (labelled("atom_ener_coeff", atom) * atom).sum(dim=1)
            diff = energy - labelled("energy", energy)
            return frame_term(diff, natoms, opts, opts.huber_delta[0], pref)
        if term == "virial":
            diff = pred["virial"] - labelled("virial", pred["virial"])
            return frame_term(diff, natoms, opts, opts.huber_delta[2], pref)
        if term == "atom_ener":
            diff = pred["atom_energy"] - labelled("atom_ener", pred["atom_energy"])
            return atom_energy_term(diff, opts, pref)
        force = pred["force"]
        if term == "drdq":
            drdq = labelled("drdq", force)
            return generalized_force_term(
                force, labelled("force", force), drdq, opts.numb_generalized_coord, pref
            )
        diff = force_diff(force, labelled("force", force), opts)
        if term == "force":
            return force_term(diff, opts, pref)
        weight = label["atom_pref"] if "atom_pref" in label else torch.ones_like(diff[..., 0])
        return weighted_force_term(diff, weight.to(diff.dtype), opts, pref)


def make_loss(
    loss: Mapping, start_lr: float, model: torch.nn.Module, ranks: int = 1
) -> EnergyLoss | TensorLoss | DOSLoss | PropertyLoss:
    """The loss of the ``loss`` section: ``tensor`` for a dipole or polar ``model`` (its label
    names the tensor), ``dos`` and ``property`` for those models, ``ener`` otherwise;
    ``ranks``: the training's world size (`PropertyLoss` scales its sums by it)."""
    kind = getattr(model, "kind", None)
    if loss.get("type") in ("dos", "property"):
        if kind != loss["type"]:
            raise MDTrainError(f"loss.type: {loss['type']!r} needs a {loss['type']} model")
        if kind == "dos":
            return DOSLoss.from_config(loss, start_lr)
        return PropertyLoss.from_config(loss, model, ranks)
    if loss.get("type") == "tensor":
        label = getattr(model, "label", None)
        if label is None:
            raise MDTrainError("loss.type: 'tensor' needs a dipole or polar model")
        return TensorLoss.from_config(loss, label)
    return EnergyLoss.from_config(loss, start_lr)


def check_labels(loss: Mapping, systems: Iterable, outputs: Mapping | None = None) -> None:
    """Raise the first of `label_problems` of ``systems`` (opened systems), naming how many
    more there are: training stops before its first step, not at the first batch."""
    problems = [p for system in systems for p in label_problems(loss, system, outputs)]
    if problems:
        more = f" (and {len(problems) - 1} more: see mdtrain check)" if len(problems) > 1 else ""
        raise MDTrainError(problems[0] + more)


def merge_metrics(
    parts: Sequence[tuple[Mapping[str, torch.Tensor | float], float]],
) -> dict[str, float]:
    """Combine metrics of micro-batches ``[(metrics, weight), ...]`` into full-batch values.

    An ``rmse*`` metric is the square root of a mean over frames, so the full-batch value is
    ``sqrt(sum_i weight_i * metric_i**2)`` with ``weight_i = micro_nf / full_nf``; an
    ``mae_*`` metric is a mean over frames: ``sum_i weight_i * metric_i``.
    """
    out: dict[str, float] = {}
    for key in parts[0][0]:
        if key.startswith("mae"):
            out[key] = sum(w * float(m[key]) for m, w in parts)
        else:
            out[key] = math.sqrt(sum(w * float(m[key]) ** 2 for m, w in parts))
    return out


class ErrorAccumulator:
    """Sums of squared and absolute errors with counts, mergeable across batches and ranks.

    Quantities: ``loss`` (per-frame loss, fed by the caller), ``e`` (energy per atom,
    dE/N, one value per frame), ``f`` (force components), ``v`` (virial per atom, dV/N,
    9 per frame). Stored as a float64 tensor of shape (4, 3): [sum sq, sum abs, count].

    ``extra``: metric names of the loss (`EnergyLoss.loss_metric_keys`: ``rmse_pf``,
    ``mae_f``, ...) kept as frame-weighted sums of the loss's own metrics, one more row each
    (an ``rmse*`` metric's square, an ``mae*`` metric as it is); `rmse` reports them too.
    """

    QUANTITIES = ("loss", "e", "f", "v")

    def __init__(self, device: torch.device | str | None = None, extra: Sequence[str] = ()) -> None:
        self.extra = tuple(extra)
        rows = len(self.QUANTITIES) + len(self.extra)
        self._sums = torch.zeros(rows, 3, dtype=torch.float64, device=device)

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
        metrics: Mapping[str, torch.Tensor | float] | None = None,
    ) -> None:
        """Add one batch of frames of one system; labels absent from ``label`` are skipped.

        ``loss`` (the batch loss, a mean over its frames) is counted once per frame, so
        `rmse()["rmse"]` is the frame-weighted root of the mean loss; ``metrics`` (the loss's,
        for the ``extra`` names) likewise, each skipped when NaN (a label the batch lacks).
        """
        nf = next(iter(pred.values())).shape[0]
        if "energy" in label and "energy" in pred:
            self._add("e", (pred["energy"] - label["energy"].to(pred["energy"].dtype)) / natoms)
        if "force" in label and "force" in pred:
            self._add("f", pred["force"] - label["force"].to(pred["force"].dtype))
        if "virial" in label and "virial" in pred:
            self._add("v", (pred["virial"] - label["virial"].to(pred["virial"].dtype)) / natoms)
        if loss is not None:
            row = self.QUANTITIES.index("loss")
            loss_t = torch.as_tensor(loss).detach().to(self._sums.device, torch.float64)
            self._sums[row, 0] += loss_t * nf
            self._sums[row, 2] += nf
        for k, key in enumerate(self.extra):
            value = torch.as_tensor(metrics[key] if metrics else math.nan, dtype=torch.float64)
            value = value.detach().to(self._sums.device)
            if not torch.isnan(value):
                row = len(self.QUANTITIES) + k
                self._sums[row, 0] += (value if key.startswith("mae") else value.square()) * nf
                self._sums[row, 2] += nf

    def merge(self, other: ErrorAccumulator) -> None:
        """Add another accumulator's sums into this one."""
        self._sums += other._sums.to(self._sums.device)

    def to_tensor(self) -> torch.Tensor:
        """The raw sums (a copy), e.g. for ``torch.distributed.all_reduce(op=SUM)``."""
        return self._sums.clone()

    @classmethod
    def from_tensor(cls, sums: torch.Tensor, extra: Sequence[str] = ()) -> ErrorAccumulator:
        """Rebuild from `to_tensor` output (after an all-reduce)."""
        acc = cls(device=sums.device, extra=extra)
        rows = len(cls.QUANTITIES) + len(acc.extra)
        acc._sums = sums.detach().to(torch.float64).reshape(rows, 3).clone()
        return acc

    def count(self, q: str) -> int:
        """Number of values accumulated for quantity ``q`` (frames for e/loss)."""
        return int(self._sums[self.QUANTITIES.index(q), 2])

    def rmse(self) -> dict[str, float]:
        """``rmse`` (sqrt of mean loss), ``rmse_e`` (eV/atom), ``rmse_f``, ``rmse_v`` and the
        ``extra`` metrics (which take precedence); NaN if empty."""
        s = self._sums.cpu().tolist()
        names = ("rmse", "rmse_e", "rmse_f", "rmse_v", *self.extra)
        out = {}
        for n, (total, _, count) in zip(names, s, strict=True):
            mean = total / count if count else math.nan
            out[n] = mean if n.startswith("mae") else math.sqrt(mean)
        return out

    def mae(self) -> dict[str, float]:
        """``mae_e`` (eV/atom), ``mae_f``, ``mae_v``; NaN if empty."""
        s = self._sums.cpu().tolist()[1 : len(self.QUANTITIES)]
        names = ("mae_e", "mae_f", "mae_v")
        return {n: r[1] / r[2] if r[2] else math.nan for n, r in zip(names, s, strict=True)}
