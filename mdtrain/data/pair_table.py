"""Tabulated pair potentials in DeePMD-kit's format (``use_srtab``, the ``pairtab`` model).

A table is a text file of rows ``r  E_00(r)  E_01(r) ... E_0n(r)  E_11(r) ... E_nn(r)``: the
distance on a uniform grid, then one energy column per unordered type pair in the upper
triangle, row by row (for two types: 0-0, 0-1, 1-1), so ``1 + n(n+1)/2`` columns in all.

This module reads and checks the file and turns it into DeePMD-kit's cubic spline table
(``deepmd/utils/pair_tab.py``), in numpy, once:

- the grid is made to reach the cut-off: a table whose last row is all zeros is padded with
  zero rows up to the grid point at or after ``rcut``; otherwise the gap is bridged by one
  cubic per column that starts at the last row with DeePMD's slope (the difference of the last
  two rows, taken as a derivative in Å⁻¹ as DeePMD-kit does) and reaches zero with zero slope
  at the last grid point before ``rcut`` (or at ``rmax + hh`` when ``rcut - rmax < 2 hh``);
- each column gets a clamped cubic spline (zero end slopes); its knot slopes, times the grid
  step ``hh``, give per interval ``u ↦ a3 u³ + a2 u² + a1 u + a0``, ``u`` the position inside
  the interval in grid steps.

The torch side (``mdtrain.model.pair_energy``) evaluates these coefficients.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mdtrain.errors import MDTrainError

log = logging.getLogger("mdtrain.data.pair_table")

# How far a grid step may stray from the first one (relative) before the table is refused:
# DeePMD-kit takes the first step for the whole table, so an uneven grid would be misread.
GRID_TOLERANCE = 1e-6


@dataclass(frozen=True)
class PairTable:
    """A table made ready for evaluation, with DeePMD-kit's serialised quantities.

    ``vdata`` is the table extended to ``rcut`` (DeePMD-kit serialises this one), ``coef``
    (ntypes, ntypes, nspline, 4) the spline coefficients ``a3, a2, a1, a0`` of each ordered
    type pair (symmetric), ``rmax`` the last distance of the file as read."""

    source: str
    rmin: float
    rmax: float
    hh: float
    rcut: float
    ntypes: int
    nspline: int
    vdata: np.ndarray
    coef: np.ndarray

    def tab_info(self) -> np.ndarray:
        """DeePMD-kit's ``tab_info``: rmin, hh, nspline, ntypes."""
        return np.array([self.rmin, self.hh, self.nspline, self.ntypes], dtype=np.float64)


def types_of_columns(ncol: int) -> int | None:
    """The number of types ``n`` with ``n(n+1)/2 == ncol``, or None when there is none."""
    n = int((math.sqrt(1 + 8 * ncol) - 1) / 2 + 0.1)
    return n if n >= 1 and n * (n + 1) // 2 == ncol else None


def read_table_file(path: str | Path) -> np.ndarray:
    """The rows of a table file (nrow, ncol) float64, checked: numbers only, the same number
    of columns on every row, at least two rows, an energy column per type pair, distances on a
    uniform increasing grid from r >= 0, all values finite. Blank lines and ``#`` comments are
    skipped, as ``numpy.loadtxt`` does for DeePMD-kit."""
    where = f"pair table {path}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise MDTrainError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise MDTrainError(f"{where}: cannot read it ({err})") from None
    rows: list[list[float]] = []
    width = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            values = [float(f) for f in fields]
        except ValueError:
            bad = next(f for f in fields if not _is_float(f))
            raise MDTrainError(f"{where}: line {lineno}: {bad!r} is not a number") from None
        if rows and len(values) != width:
            raise MDTrainError(
                f"{where}: line {lineno} has {len(values)} columns, the first row {width}"
            )
        width = len(values)
        rows.append(values)
    if len(rows) < 2:
        raise MDTrainError(f"{where}: needs at least 2 rows (distance, energies), has {len(rows)}")
    data = np.asarray(rows, dtype=np.float64)
    _check_columns(data, where)
    _check_grid(data, where)
    return data


def _is_float(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def _check_columns(data: np.ndarray, where: str) -> None:
    ncol = data.shape[1] - 1
    if ncol < 1 or types_of_columns(ncol) is None:
        raise MDTrainError(
            f"{where}: {ncol} energy columns after the distance; a table for n types has "
            "n(n+1)/2 of them (1, 3, 6, 10, ...)"
        )
    bad = np.argwhere(~np.isfinite(data))
    if bad.size:
        row, col = bad[0]
        raise MDTrainError(f"{where}: row {row + 1}, column {col + 1} is {data[row, col]}")


def _check_grid(data: np.ndarray, where: str) -> None:
    r = data[:, 0]
    if r[0] < 0:
        raise MDTrainError(f"{where}: the first distance {r[0]} is negative")
    step = np.diff(r)
    hh = step[0]
    if hh <= 0:
        raise MDTrainError(f"{where}: distances must increase (rows 1-2: {r[0]}, {r[1]})")
    off = np.abs(step - hh) > GRID_TOLERANCE * hh
    if off.any():
        k = int(np.argmax(off))
        raise MDTrainError(
            f"{where}: distances must be evenly spaced (step {hh:g} between rows 1-2, "
            f"{step[k]:g} between rows {k + 1}-{k + 2})"
        )


def check_table_types(ntypes_table: int, type_map: list[str], where: str) -> None:
    """Refuse a table written for another number of types than ``type_map`` has."""
    if ntypes_table != len(type_map):
        pairs = ntypes_table * (ntypes_table + 1) // 2
        need = len(type_map) * (len(type_map) + 1) // 2
        raise MDTrainError(
            f"{where}: has {pairs} energy columns, a table for {ntypes_table} types, but "
            f"type_map {type_map} has {len(type_map)} types ({need} columns)"
        )


def extend_to_rcut(vdata: np.ndarray, rcut: float) -> np.ndarray:
    """DeePMD-kit's table as it is used up to ``rcut``: padded with zeros, or bridged to zero
    by one cubic per column, when ``rcut`` lies beyond the last row (module docstring)."""
    rmin, rmax = vdata[0, 0], vdata[-1, 0]
    hh = vdata[1, 0] - vdata[0, 0]
    upper = vdata[-1, 1:]
    last = vdata.shape[0] - 1
    rcut_idx = int(np.ceil(rcut / hh - rmin / hh))  # DeePMD-kit's expression, rounding and all
    if rcut <= rmax or rcut_idx - last <= 0:
        if np.any(upper != 0) or (rcut < rmax and np.any(vdata[rcut_idx - 1, 1:] != 0)):
            log.warning("pair table: the energy does not decay to 0 at rcut %g", rcut)
        return vdata
    npad = rcut_idx - last
    pad = np.zeros((npad, vdata.shape[1]), dtype=np.float64)
    pad[:, 0] = np.linspace(rmax + hh, rmax + hh * npad, npad)
    if np.all(upper == 0):
        return np.concatenate([vdata, pad])
    log.warning(
        "pair table: rcut %g lies beyond the table's last distance %g; extrapolating", rcut, rmax
    )
    slope = vdata[-1, 1:] - vdata[-2, 1:]
    grid_point = -2 if pad[-1, 0] / hh - rmax / hh >= 2 else -1
    x0, x1 = rmax, pad[grid_point, 0]
    pad[:, 1:] = _hermite_to_zero(pad[:, 0], x0, x1, upper, slope)
    return np.concatenate([vdata, pad if grid_point == -1 else pad[:-1]])


def _hermite_to_zero(
    x: np.ndarray, x0: float, x1: float, v0: np.ndarray, s0: np.ndarray
) -> np.ndarray:
    """The cubic through (x0, v0) with slope s0 and (x1, 0) with slope 0, at x (n,)."""
    length = x1 - x0
    t = ((x - x0) / length)[:, None]
    h00 = (1 + 2 * t) * (1 - t) ** 2
    h10 = t * (1 - t) ** 2
    return h00 * v0[None, :] + h10 * length * s0[None, :]


def clamped_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Knot slopes (n, m) of the clamped cubic spline through (x, y[:, k]) for each column k
    (zero slope at both ends): the tridiagonal continuity equations of the second derivative,
    solved by the Thomas algorithm."""
    n = x.shape[0]
    slopes = np.zeros_like(y)
    if n <= 2:
        return slopes
    h = np.diff(x)
    delta = np.diff(y, axis=0) / h[:, None]
    # unknowns m_1..m_{n-2}; row i: h_i m_{i-1} + 2(h_{i-1}+h_i) m_i + h_{i-1} m_{i+1} = rhs
    lower = h[2:]  # coefficient of m_{i-1} on row i, i = 2..n-2
    diag = 2.0 * (h[:-1] + h[1:])
    upper = h[:-2]  # coefficient of m_{i+1} on row i, i = 1..n-3
    rhs = 3.0 * (h[1:, None] * delta[:-1] + h[:-1, None] * delta[1:])
    k = n - 2
    c = np.zeros(k)
    d = np.zeros_like(rhs)
    c[0] = upper[0] / diag[0] if k > 1 else 0.0
    d[0] = rhs[0] / diag[0]
    for i in range(1, k):
        denom = diag[i] - lower[i - 1] * c[i - 1]
        c[i] = upper[i] / denom if i < k - 1 else 0.0
        d[i] = (rhs[i] - lower[i - 1] * d[i - 1]) / denom
    for i in range(k - 2, -1, -1):
        d[i] = d[i] - c[i] * d[i + 1]
    slopes[1:-1] = d
    return slopes


def spline_coefficients(vdata: np.ndarray) -> np.ndarray:
    """DeePMD-kit's coefficients (ntypes, ntypes, nspline, 4) of an extended table."""
    ntypes = types_of_columns(vdata.shape[1] - 1)
    assert ntypes is not None
    x = vdata[:, 0]
    hh = vdata[1, 0] - vdata[0, 0]
    values = vdata[:, 1:]
    dd = clamped_slopes(x, values) * hh
    v0, v1, d0, d1 = values[:-1], values[1:], dd[:-1], dd[1:]
    per_column = np.stack(
        [2 * v0 - 2 * v1 + d0 + d1, -3 * v0 + 3 * v1 - 2 * d0 - d1, d0, v0], axis=-1
    )  # (nspline, ncol, 4)
    coef = np.zeros((ntypes, ntypes, vdata.shape[0] - 1, 4), dtype=np.float64)
    col = 0
    for t0 in range(ntypes):
        for t1 in range(t0, ntypes):
            coef[t0, t1] = coef[t1, t0] = per_column[:, col]
            col += 1
    return coef


def load_pair_table(
    path: str | Path, rcut: float, type_map: list[str] | None = None, key: str = "tab_file"
) -> PairTable:
    """Read, check and prepare the table at ``path`` for a cut-off ``rcut``; ``key`` names the
    input key that gave the file in messages, ``type_map`` (when given) must match it."""
    return prepare_table(read_table_file(path), str(path), rcut, type_map, key)


def check_rows(data: np.ndarray, where: str) -> None:
    """The checks of ``read_table_file`` on rows given as an array (a stored model's)."""
    if data.ndim != 2 or data.shape[0] < 2:
        raise MDTrainError(f"{where}: a table needs at least 2 rows, got shape {data.shape}")
    _check_columns(data, where)
    _check_grid(data, where)


def prepare_table(
    raw: np.ndarray, source: str, rcut: float, type_map: list[str] | None, key: str
) -> PairTable:
    """The checked rows ``raw`` of the table ``source`` made ready for a cut-off ``rcut``."""
    ntypes = types_of_columns(raw.shape[1] - 1)
    assert ntypes is not None
    if type_map is not None:
        check_table_types(ntypes, list(type_map), f"{key} {source}")
    vdata = extend_to_rcut(raw, float(rcut))
    return PairTable(
        source=source,
        rmin=float(raw[0, 0]),
        rmax=float(raw[-1, 0]),
        hh=float(raw[1, 0] - raw[0, 0]),
        rcut=float(rcut),
        ntypes=ntypes,
        nspline=vdata.shape[0] - 1,
        vdata=vdata,
        coef=spline_coefficients(vdata),
    )


def table_for_types(
    rows: np.ndarray, old_map: list[str], new_map: list[str], where: str
) -> np.ndarray:
    """The rows of a table written for ``old_map`` with its energy columns rearranged for
    ``new_map`` (the pair (a, b) of new types takes the column of the same two elements), as
    fine-tuning under a new type_map needs; a pair of elements the table has no column for
    is refused, naming it and ``where`` (the file)."""
    rows = np.asarray(rows, dtype=np.float64)
    check_table_types(types_of_columns(rows.shape[1] - 1) or 0, list(old_map), where)
    n_old = len(old_map)
    column = {}  # (i, j), i <= j, of the old types -> its column in the rows
    for i in range(n_old):
        for j in range(i, n_old):
            column[(i, j)] = 1 + len(column)
    out = [rows[:, 0]]
    for a in range(len(new_map)):
        for b in range(a, len(new_map)):
            missing = [name for name in (new_map[a], new_map[b]) if name not in old_map]
            if missing:
                raise MDTrainError(
                    f"{where}: no column for the pair {new_map[a]}-{new_map[b]} ({missing[0]} "
                    f"is not in the table's type_map {list(old_map)})"
                )
            i, j = sorted((old_map.index(new_map[a]), old_map.index(new_map[b])))
            out.append(rows[:, column[(i, j)]])
    return np.stack(out, axis=1)
