"""The terms of the ``ener`` loss beyond plain mean squared errors: DeePMD-kit 3.2's options
(``deepmd/pt/loss/ener.py``), for a batch of ``nf`` frames of one system of ``N`` atoms.

Each function returns the term's contribution, its prefactor ``pref`` applied, and the error
it displays (``(value, metric)``). Every contribution is a mean over frames of per-frame
values (all frames have N atoms), so micro-batches weighted by their share of frames add
up to the full batch. Written from DeePMD-kit's definitions::

    huber(x, d)   = 0.5 x^2 if |x| <= d else d (|x| - d/2), averaged over its elements
    energy  mse   mean(dE^2) / N^k (k = 2 with intensive_ener_virial, else 1)  rmse_e
            huber mean(huber(dE / N, d_e))                                    rmse_e
            mae   mean(|dE|) / N                                              mae_e
    force   mse   mean(dF^2) over components, huber over components or, with f_use_norm,
            over each atom's |dF|; mae likewise; dF divided per atom by
            |F_label| + relative_f when that is set                          rmse_f / mae_f
    virial  as energy, over the 9 components                                  rmse_v / mae_v
    ae      mse/huber/mae of the atomic energies (huber with d_e)             rmse_ae / mae_ae
    pf      mean(w dF^2) or mean(w |dF|), w the atom's weight                 rmse_pf / mae_pf
    gf      mean((drdq^T F_label - drdq^T F_pred)^2), always squared          rmse_gf
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossOptions:
    """The options of the ``loss`` section that change how terms are computed."""

    loss_func: str = "mse"
    use_huber: bool = False
    huber_delta: tuple[float, float, float] = (0.01, 0.01, 0.01)  # energy, force, virial
    f_use_norm: bool = False
    relative_f: float | None = None
    intensive_ener_virial: bool = False
    enable_atom_ener_coeff: bool = False
    use_default_pf: bool = False
    numb_generalized_coord: int = 0

    @classmethod
    def from_config(cls, loss: Mapping[str, Any]) -> LossOptions:
        delta = loss.get("huber_delta", 0.01)
        deltas = tuple(float(d) for d in delta) if isinstance(delta, list) else (float(delta),) * 3
        relative = loss.get("relative_f")
        return cls(
            loss_func=str(loss.get("loss_func", "mse")),
            use_huber=bool(loss.get("use_huber", False)),
            huber_delta=deltas,  # type: ignore[arg-type]
            f_use_norm=bool(loss.get("f_use_norm", False)),
            relative_f=None if relative is None else float(relative),
            intensive_ener_virial=bool(loss.get("intensive_ener_virial", False)),
            enable_atom_ener_coeff=bool(loss.get("enable_atom_ener_coeff", False)),
            use_default_pf=bool(loss.get("use_default_pf", False)),
            numb_generalized_coord=int(loss.get("numb_generalized_coord", 0)),
        )

    @property
    def mae(self) -> bool:
        return self.loss_func == "mae"

    @property
    def huber(self) -> bool:
        """Huber applies to the squared-error path only (DeePMD-kit ignores it with mae)."""
        return self.use_huber and not self.mae


def huber(x: Tensor, delta: float) -> Tensor:
    """Mean Huber loss of the residuals ``x``."""
    ax = x.abs()
    return torch.where(ax <= delta, 0.5 * x.square(), delta * (ax - 0.5 * delta)).mean()


def frame_term(
    diff: Tensor, natoms: int, opts: LossOptions, delta: float, pref: float
) -> tuple[Tensor, Tensor]:
    """Energy (nf,) or virial (nf, 3, 3) errors: ``(pref x loss value, displayed error)``."""
    if opts.mae:
        mae = diff.abs().mean() / natoms
        return pref * mae, mae.detach()
    squared = diff.square()
    # a mean over one value per frame (the energy's) is that value: no pass, no node
    per_frame = squared if squared.dim() == 1 else squared.reshape(diff.shape[0], -1).mean(dim=1)
    # the mean over one frame is its value (x / 1): a view, not a pass and a node each way
    mse = per_frame.view(()) if per_frame.numel() == 1 else per_frame.mean()
    rmse = mse.detach().sqrt() / natoms
    if opts.huber:
        return pref * huber(diff / natoms, delta), rmse
    if opts.intensive_ener_virial:
        return pref * mse / (natoms * natoms), rmse
    return pref * mse / natoms, rmse  # the default: the operations of mdtrain before options


def force_diff(pred: Tensor, label: Tensor, opts: LossOptions) -> Tensor:
    """Force errors (nf, N, 3), divided per atom by ``|F_label| + relative_f`` when set."""
    diff = pred - label
    if opts.relative_f is not None:
        diff = diff / (label.norm(dim=-1, keepdim=True) + opts.relative_f)
    return diff


def force_term(diff: Tensor, opts: LossOptions, pref: float) -> tuple[Tensor, Tensor]:
    """The force term of errors ``diff`` (nf, N, 3)."""
    if opts.mae:
        value = diff.norm(dim=-1).mean() if opts.f_use_norm else diff.abs().mean()
        return pref * value, value.detach()
    mse = diff.square().mean()
    if opts.huber:
        residual = diff.norm(dim=-1) if opts.f_use_norm else diff
        return pref * huber(residual, opts.huber_delta[1]), mse.detach().sqrt()
    return pref * mse, mse.detach().sqrt()


def atom_energy_term(diff: Tensor, opts: LossOptions, pref: float) -> tuple[Tensor, Tensor]:
    """Atomic energy errors (nf, N)."""
    if opts.mae:
        value = diff.abs().mean()
        return pref * value, value.detach()
    mse = diff.square().mean()
    if opts.huber:
        return pref * huber(diff, opts.huber_delta[0]), mse.detach().sqrt()
    return pref * mse, mse.detach().sqrt()


def weighted_force_term(
    diff: Tensor, weight: Tensor, opts: LossOptions, pref: float
) -> tuple[Tensor, Tensor]:
    """Force errors (nf, N, 3) weighted per atom by ``weight`` (nf, N)."""
    w = weight.unsqueeze(-1)
    if opts.mae:
        value = (diff.abs() * w).mean()
        return pref * value, value.detach()
    value = (diff.square() * w).mean()
    return pref * value, value.detach().sqrt()


def generalized_force_term(
    pred: Tensor, label: Tensor, drdq: Tensor, ncoord: int, pref: float
) -> tuple[Tensor, Tensor]:
    """Errors of the generalized forces ``drdq^T F`` (drdq: (nf, N, 3 x ncoord))."""
    nf = pred.shape[0]
    jac = drdq.reshape(nf, -1, ncoord)  # (nf, 3N, ncoord): per atom, 3 rows of ncoord
    gen_pred = torch.einsum("bij,bi->bj", jac, pred.reshape(nf, -1))
    gen_label = torch.einsum("bij,bi->bj", jac, label.reshape(nf, -1))
    mse = (gen_label - gen_pred).square().mean()
    return pref * mse, mse.detach().sqrt()
