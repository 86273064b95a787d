"""Pair tables the tests make themselves: the ZBL screened Coulomb repulsion on a grid."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from tests.helpers.training import make_project

ATOMIC_NUMBER = {"H": 1.0, "C": 6.0, "O": 8.0}


def zbl_energy(r: np.ndarray, zi: float, zj: float) -> np.ndarray:
    """The universal ZBL screened Coulomb energy (eV) at r (Å)."""
    a = 0.46850 / (zi**0.23 + zj**0.23)
    x = r / a
    phi = (
        0.18175 * np.exp(-3.19980 * x)
        + 0.50986 * np.exp(-0.94229 * x)
        + 0.28022 * np.exp(-0.40290 * x)
        + 0.02817 * np.exp(-0.20162 * x)
    )
    return 14.399645 * zi * zj / r * phi


def zbl_table(type_map: list[str], rmin: float, rmax: float, hh: float, zero_from=None):
    """Rows ``r, E_00, E_01, ...`` (upper triangle of type pairs) on a uniform grid; with
    ``zero_from``, each energy is brought smoothly to exactly 0 at that distance."""
    n = round((rmax - rmin) / hh) + 1
    r = rmin + hh * np.arange(n)
    cols = [r]
    for i, j in itertools.combinations_with_replacement(range(len(type_map)), 2):
        e = zbl_energy(r, ATOMIC_NUMBER[type_map[i]], ATOMIC_NUMBER[type_map[j]])
        if zero_from is not None:
            e = np.where(r < zero_from, e * (1 - (r / zero_from) ** 2) ** 3, 0.0)
        cols.append(e)
    return np.stack(cols, axis=1)


def write_table(path: Path, rows: np.ndarray) -> Path:
    """``rows`` as DeePMD-kit's text table (round-trips float64 exactly)."""
    np.savetxt(path, rows, fmt="%.18e")
    return path


def linear_input(tmp_path, sel="auto", numb_steps=4) -> Path:
    """The tiny project (`make_project`) with its model made a ``linear_ener`` of its network
    and a ZBL table (weights 0.8 and 1.0)."""
    path = make_project(tmp_path, numb_steps=numb_steps, save_freq=numb_steps)
    config = json.loads(path.read_text())
    net = config["model"]
    type_map = net.pop("type_map")
    net["descriptor"]["sel"] = sel
    write_table(tmp_path / "d3.txt", zbl_table(type_map, 0.1, 4.5, 0.01, zero_from=4.0))
    table = {
        "type": "pairtab",
        "tab_file": "d3.txt",
        "rcut": 4.5,
        "sel": sel if sel == "auto" else 60,
    }
    config["model"] = {"type": "linear_ener", "type_map": type_map, "models": [net, table],
                       "weights": [0.8, 1.0], "data_stat_nbatch": 2}  # fmt: skip
    path.write_text(json.dumps(config))
    return path
