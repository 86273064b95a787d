"""The default ``ener`` loss — mean squared energy and force errors, no options — as one
autograd node with a written backward, the same bits as the operations it replaces.

Written as operations (``loss_terms.frame_term`` and ``force_term``) the loss is a dozen
small forward operations and nine autograd nodes (sub, pow, mean or view, mul, div for each
term and the sum), each a few microseconds of one thread a step. Here the forward runs the
same operations without recording them, and the backward repeats, value for value, what
those nodes compute (torch's formulas: ``AddBackward0`` passes the cotangent g on;
``DivBackward0`` g / N; ``MulBackward0`` g · pref; ``MeanBackward0`` g / numel;
``ViewBackward0`` a reshape; ``PowBackward0`` of ``square`` g · (2 · diff); ``SubBackward0``
passes g to the prediction): every rounding is the same, so the gradient is bit for bit
autograd's (``tests/train/test_loss_mse.py``). ``EnergyLoss`` chooses it once per set of
label names, when the energy and force terms are the ones that contribute.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mdtrain.train.loss_terms import LossOptions


class _EnergyForceMse(torch.autograd.Function):
    """``pref_e · mse(dE) / N + pref_f · mse(dF)`` and the two terms' displayed errors."""

    @staticmethod
    def forward(ctx, energy, force, energy_label, force_label, natoms, pref_e, pref_f):
        diff_e = energy - energy_label
        squared = diff_e.square()
        # a mean over one frame is its value: a view, as frame_term takes it
        mse_e = squared.view(()) if squared.numel() == 1 else squared.mean()
        diff_f = force - force_label
        mse_f = diff_f.square().mean()
        loss = pref_e * mse_e / natoms + pref_f * mse_f
        rmse_e = mse_e.sqrt() / natoms
        rmse_f = mse_f.sqrt()
        ctx.save_for_backward(diff_e, diff_f)
        ctx.consts = (natoms, pref_e, pref_f)
        ctx.mark_non_differentiable(rmse_e, rmse_f)
        return loss, rmse_e, rmse_f

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor, *_):
        (diff_e, diff_f), (natoms, pref_e, pref_f) = ctx.saved_tensors, ctx.consts
        energy_bar = force_bar = None
        if ctx.needs_input_grad[0]:
            ge = g / natoms * pref_e  # DivBackward0, then MulBackward0
            if diff_e.numel() > 1:
                ge = ge / diff_e.numel()  # MeanBackward0 (a view's backward: a reshape)
            energy_bar = ge * (2.0 * diff_e)  # PowBackward0 of square
        if ctx.needs_input_grad[1]:
            gf = g * pref_f / diff_f.numel()  # MulBackward0, then MeanBackward0
            force_bar = gf * (2.0 * diff_f)
        return energy_bar, force_bar, None, None, None, None, None


def energy_force_mse(
    energy: Tensor,
    force: Tensor,
    energy_label: Tensor,
    force_label: Tensor,
    natoms: int,
    pref_e: float,
    pref_f: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The loss (0-d, the energy's dtype), ``rmse_e`` and ``rmse_f`` (detached) of the
    default energy and force terms; labels already in the predictions' dtype."""
    return _EnergyForceMse.apply(energy, force, energy_label, force_label, natoms, pref_e, pref_f)


def fusable(layout: list[tuple[str, str, bool]], options: LossOptions) -> bool:
    """Whether a loss of this layout (``EnergyLoss._layout``: term, metric name, whether it
    contributes) is the default energy and force terms alone, which ``fused_loss`` runs."""
    on = [term for term, _, contributes in layout if contributes]
    return on == ["energy", "force"] and options == LossOptions()


def fused_loss(energy_loss, layout, pred, label, natoms: int, lr: float, weight: float):
    """``EnergyLoss.__call__`` for a ``fusable`` layout: the same loss, gradient and metrics
    (a term that does not contribute displays NaN, as there)."""
    ref, force = pred["energy"], pred["force"]
    loss, rmse_e, rmse_f = energy_force_mse(
        ref, force, label["energy"].to(ref.dtype), label["force"].to(force.dtype), natoms,
        energy_loss.pref("energy", lr), energy_loss.pref("force", lr),
    )  # fmt: skip
    shown = {"energy": rmse_e, "force": rmse_f}
    metrics = {key: shown[t] if on else ref.new_full((), math.nan) for t, key, on in layout}
    metrics["rmse"] = loss.detach().sqrt()
    # x * 1.0 is x, and so is its gradient: the whole batch's loss skips the product
    return (loss if weight == 1.0 else loss * weight), metrics


_READS = {"energy": "energy", "virial": "virial", "atom_ener": "atom_energy"}  # else "force"


def output_reads(terms: list[str], options: LossOptions) -> set[str]:
    """The predictions an ``ener`` loss of these configured terms reads (``EnergyLoss.reads``)."""
    names = {"energy"}  # the reference of the loss's dtype, whatever the terms
    for term in terms:
        if term == "energy" and options.enable_atom_ener_coeff:
            names.add("atom_energy")
        names.add(_READS.get(term, "force"))  # force, atom_pref, drdq: the forces
    return names
