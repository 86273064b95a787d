"""Committees for the model-deviation tests: small models of every file kind, DeePMD-kit's
deviation definitions written out independently of ``mdtrain.infer.deviation`` (explicit
loops over models and atoms), and a reader of ``model_devi.out``."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np

from mdtrain.infer.freeze import freeze_model
from mdtrain.model.deepmd_file import write_dp
from tests.helpers.models import TINY_CONFIG, save_tiny_checkpoint, tiny_model

#: What DeePMD-kit 3.2.0's ``dp model-devi`` writes above a system's rows (``# SYSTEM``
#: first), copied from its output on .pb models: ``step`` 10 wide, the names 19 wide.
DEEPMD_HEADER = (
    "# step      max_devi_v         min_devi_v         avg_devi_v         max_devi_f  "
    "       min_devi_f         avg_devi_f         devi_e             "
)
DEEPMD_ATOMIC_HEADER = DEEPMD_HEADER + "atm_devi_f(N)      "
#: One of its rows (step 0 of that output): the step ``%12d``, then ``%19.6e`` values.
DEEPMD_ROW = (
    "           0       6.825343e-02       3.494523e-03       3.562248e-02       "
    "2.058278e-01       6.641965e-02       1.253781e-01       3.235362e-01"
)


def member_model(k: int, rcut: float | None = None, sel: list[int] | None = None):
    """Member ``k``: the tiny float64 tanh model (rcut 4, sel [16, 32]) with seeds shifted
    by ``k`` and its own statistics; ``rcut``/``sel`` change the neighbour list it needs."""
    config = copy.deepcopy(TINY_CONFIG)
    config["descriptor"]["seed"] = 10 + k
    config["fitting_net"]["seed"] = 20 + k
    if rcut is not None:
        config["descriptor"]["rcut"] = rcut
    if sel is not None:
        config["descriptor"]["sel"] = sel
    return tiny_model(seed=k, config=config)


def write_model(model, path: Path) -> str:
    """``model`` as the file kind ``path``'s suffix names: .pt checkpoint, .pth frozen
    TorchScript, .dp DeePMD-kit."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".pth":
        freeze_model(model, path)
    elif path.suffix == ".dp":
        write_dp(model, path)
    else:
        save_tiny_checkpoint(path, model)
    return str(path)


def committee_folder(root: Path, models) -> str:
    """The layout ``mdtrain train --ensemble`` writes: ``member-k/model.ckpt.pt``."""
    for k, model in enumerate(models):
        write_model(model, Path(root) / f"member-{k}" / "model.ckpt.pt")
    return str(root)


def reference_deviation(
    energy: np.ndarray,
    force: np.ndarray,
    virial: np.ndarray,
    relative: float | None = None,
    relative_v: float | None = None,
) -> np.ndarray:
    """One frame's row of ``model_devi.out`` after the step (then the atoms' force
    deviations), from every model's ``energy`` (m,), ``force`` (m, N, 3) and ``virial``
    (m, 3, 3), by DeePMD-kit's documented definitions."""
    m, natoms = force.shape[:2]
    eps_f = np.zeros(natoms)
    for i in range(natoms):
        mean = sum(force[k, i] for k in range(m)) / m
        eps_f[i] = np.sqrt(
            sum(float(np.dot(force[k, i] - mean, force[k, i] - mean)) for k in range(m)) / m
        )
        if relative is not None:
            eps_f[i] /= np.sqrt(float(np.dot(mean, mean))) + relative
    w = [virial[k].reshape(9) / natoms for k in range(m)]
    w_mean = sum(w) / m
    eps_v = np.sqrt(sum((w[k] - w_mean) ** 2 for k in range(m)) / m)
    if relative_v is not None:
        eps_v = eps_v / (np.sqrt(float(np.dot(w_mean, w_mean))) + relative_v)
    e = [energy[k] / natoms for k in range(m)]
    e_mean = sum(e) / m
    eps_e = np.sqrt(sum((e[k] - e_mean) ** 2 for k in range(m)) / m)
    head = [
        eps_v.max(),
        eps_v.min(),
        np.sqrt(np.mean(eps_v**2)),  # DeePMD's avg_devi_v: the root mean square (|eps| / 3)
        eps_f.max(),
        eps_f.min(),
        eps_f.mean(),
        eps_e,
    ]
    return np.array(head + list(eps_f))


def read_model_devi(path: str | os.PathLike) -> list[tuple[str, str, np.ndarray]]:
    """The blocks of a ``model_devi.out``: (title line, column-name line, rows)."""
    blocks: list[tuple[str, str, list]] = []
    lines = Path(path).read_text().splitlines()
    k = 0
    while k < len(lines):
        assert lines[k].startswith("# "), f"line {k + 1}: {lines[k]!r}"
        title, names = lines[k][2:], lines[k + 1]
        rows = []
        k += 2
        while k < len(lines) and not lines[k].startswith("#"):
            rows.append([float(v) for v in lines[k].split()])
            k += 1
        blocks.append((title, names, rows))
    return [(t, n, np.array(r)) for t, n, r in blocks]


def assert_printed_equal(got: np.ndarray, expected: np.ndarray) -> None:
    """``got`` (read from a ``%19.6e`` column) equals ``expected`` to that precision: within
    one unit of the 7th significant digit (the printed half-unit, with room for values that
    sit on a rounding boundary)."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    unit = 10.0 ** (np.floor(np.log10(np.maximum(np.abs(expected), 1e-300))) - 6)
    bad = np.abs(got - expected) > unit
    assert not bad.any(), (
        f"{bad.sum()} values differ beyond the printed precision, first at "
        f"{np.argwhere(bad)[0].tolist()}: {got[bad][0]!r} vs {expected[bad][0]!r}"
    )
