"""The per-type energy bias: DeePMD's least-squares fit of ``N_types · bias = E`` over the
sampled frames, solved from the stacked QR factors of every rank's rows."""

import math

import numpy as np

from mdtrain.model.stats.share import ALONE, StatShare


def energy_bias_factor(natoms_per_type: np.ndarray, energies: np.ndarray) -> np.ndarray:
    """(ntypes+1, ntypes+1): the triangular factor R of a QR factorisation of ``[N | E]``,
    zero rows added when there are fewer frames.

    What ranks exchange for the energy bias: the factors of row blocks stacked have the Gram
    matrix of the whole ``[N | E]`` (the sum of theirs), hence its singular values and its
    least-squares solutions, and, unlike the normal equations ``NᵀN``, ``NᵀE``, they keep
    the condition number of ``N`` instead of squaring it (the minimum-norm solution of
    one-composition data, where ``N`` has rank one, stays well defined).
    """
    block = np.hstack([natoms_per_type, energies.reshape(-1, 1)])
    size = block.shape[1]
    factor = np.zeros((size, size))
    if len(block):
        r = np.linalg.qr(block, mode="r")
        factor[: len(r)] = r
    return factor


def compute_energy_bias(
    natoms_per_type: np.ndarray,
    energies: np.ndarray,
    rcond: float | None = None,
    share: StatShare = ALONE,
) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares per-type energy (ntypes,) and the residual std (same value per type).

    DeePMD's definition: ``lstsq(N, E, rcond)`` over all sampled frames (minimum-norm, the
    singular values of ``N`` below ``rcond`` times the largest cut, by default machine
    precision times the number of frames), then ``std(E - N · bias)``. The rows given are
    this rank's; the solve runs on the stacked factors of every rank
    (``energy_bias_factor``), the std from summed residuals, on every rank alike. The frames
    of all ranks together must be at least one.
    """
    n = np.asarray(natoms_per_type, dtype=np.float64)
    e = np.asarray(energies, dtype=np.float64).reshape(-1)
    if n.ndim != 2 or n.shape[0] != e.shape[0]:
        raise ValueError(f"natoms_per_type {n.shape} does not match energies {e.shape}")
    ntypes = n.shape[1]
    size = (ntypes + 1) ** 2
    slots = np.zeros(share.world * size + 1)
    slots[share.rank * size : (share.rank + 1) * size] = energy_bias_factor(n, e).ravel()
    slots[-1] = len(e)
    slots = share.total(slots)
    nrows = int(round(slots[-1]))
    if nrows == 0:
        raise ValueError("no frame to fit the energy bias to")
    stacked = slots[:-1].reshape(share.world * (ntypes + 1), ntypes + 1)
    cut = rcond if rcond is not None else np.finfo(np.float64).eps * max(nrows, ntypes)
    bias = np.linalg.lstsq(stacked[:, :ntypes], stacked[:, ntypes], rcond=cut)[0]
    residual = e - n @ bias
    mean = share.total(np.array([residual.sum()]))[0] / nrows
    squares = share.total(np.array([np.square(residual - mean).sum()]))[0]
    return bias, np.full(ntypes, math.sqrt(squares / nrows))
