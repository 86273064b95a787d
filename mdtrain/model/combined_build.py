"""Building the combined models from the ``model`` section, with DeePMD-kit 3.2's keys.

- ``use_srtab`` (a table file) on an energy model: DP+ZBL, the table read with the
  descriptor's ``rcut`` and ``sum(sel)`` neighbours, switched by ``sw_rmin``/``sw_rmax``
  (required) and ``smin_alpha`` (default 0.1, DeePMD-kit's);
- ``"type": "pairtab"``: ``tab_file``, ``rcut``, ``sel`` (an integer or a list, summed);
- ``"type": "linear_ener"``: ``models`` (energy models and ``pairtab`` models, sharing the
  parent's ``type_map``) and ``weights`` (``"sum"``, ``"mean"`` or one number per model).

Table files are read relative to ``base_dir`` (the input file's folder); the returned model
keeps its config with the paths made absolute and the table's rows (``table_rows``), so a
checkpoint or a ``.dp`` file rebuilds it without the file.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np

from mdtrain.config.model_kind import table_sections
from mdtrain.data.pair_table import check_rows, prepare_table, read_table_file
from mdtrain.errors import MDTrainError
from mdtrain.model.combined import CombinedModel, ZBLModel
from mdtrain.model.energy import EnergyModel
from mdtrain.model.pair_energy import PairTableEnergy

log = logging.getLogger("mdtrain")

SRTAB_KEYS = ("use_srtab", "smin_alpha", "sw_rmin", "sw_rmax", "srtab_add_bias")
# where a built model's config keeps its table (rows as read), so that a checkpoint or a
# .dp file rebuilds the model without the file
TABLE_ROWS = "table_rows"
SMIN_ALPHA_DEFAULT = 0.1


def is_combined(model_config: dict) -> bool:
    """Whether the ``model`` section asks for one of the models built here."""
    return "use_srtab" in model_config or model_config.get("type") in ("pairtab", "linear_ener")


def _table_path(value, base_dir: Path | None, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise MDTrainError(f"{where}: a table file name is required, got {value!r}")
    path = Path(value)
    return (path if path.is_absolute() or base_dir is None else Path(base_dir) / path).resolve()


def _table(cfg: dict, key: str, rcut: float, type_map: list[str], base_dir, where: str):
    """The table of section ``cfg`` (its file ``cfg[key]``, or the rows a stored model keeps
    in ``table_rows``) and the section as stored: path made absolute, rows included."""
    rows = cfg.get(TABLE_ROWS)
    if rows is not None:  # a checkpoint's or a .dp file's own copy of the table
        source = str(cfg.get(key))
        raw = np.asarray(rows, dtype=np.float64)
        check_rows(raw, f"{where}/{TABLE_ROWS} (of {source})")
    else:
        path = _table_path(cfg.get(key), base_dir, f"{where}/{key}")
        source, raw = str(path), read_table_file(path)
    table = prepare_table(raw, source, rcut, type_map, f"{where}/{key}")
    return table, dict(cfg, **{key: source, TABLE_ROWS: raw.tolist()})


def _type_map(cfg: dict, where: str) -> list[str]:
    type_map = cfg.get("type_map")
    if (
        not isinstance(type_map, list)
        or not type_map
        or not all(isinstance(t, str) for t in type_map)
    ):
        raise MDTrainError(f"{where}/type_map: a non-empty list of element names is required")
    return list(type_map)


def _number(cfg: dict, key: str, where: str) -> float:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MDTrainError(f"{where}/{key}: a number is required, got {value!r}")
    return float(value)


def _pairtab(cfg: dict, type_map: list[str], base_dir: Path | None, where: str):
    """The table part of a ``pairtab`` section and that section with its path made absolute."""
    rcut = _number(cfg, "rcut", where)
    sel = cfg.get("sel")
    if isinstance(sel, list) and all(isinstance(s, int) and s >= 0 for s in sel):
        nsel = sum(sel)
    elif isinstance(sel, int) and not isinstance(sel, bool):
        nsel = sel
    else:
        raise MDTrainError(
            f"{where}/sel: an integer or a list of integers is required, got {sel!r}"
        )
    if nsel <= 0:
        raise MDTrainError(f"{where}/sel: must be positive, got {sel!r}")
    table, stored = _table(cfg, "tab_file", rcut, type_map, base_dir, where)
    return PairTableEnergy(table, type_map, nsel), stored


def _zbl(cfg: dict, base_dir: Path | None) -> ZBLModel:
    type_map = _type_map(cfg, "model")
    sw_rmin, sw_rmax = _number(cfg, "sw_rmin", "model"), _number(cfg, "sw_rmax", "model")
    if not sw_rmax > sw_rmin:
        raise MDTrainError(f"model/sw_rmax: {sw_rmax} must be greater than sw_rmin {sw_rmin}")
    given = cfg.get("smin_alpha") is not None
    alpha = _number(cfg, "smin_alpha", "model") if given else SMIN_ALPHA_DEFAULT
    if alpha <= 0:
        raise MDTrainError(f"model/smin_alpha: must be positive, got {alpha}")
    dp = EnergyModel({k: v for k, v in cfg.items() if k not in (*SRTAB_KEYS, TABLE_ROWS)})
    table, stored = _table(cfg, "use_srtab", dp.rcut, type_map, base_dir, "model")
    stored = {**stored, **dp.get_model_config(), "smin_alpha": alpha}
    part = PairTableEnergy(table, type_map, sum(dp.sel))
    return ZBLModel(dp, part, sw_rmin, sw_rmax, alpha, type_map, stored)


def _weights(value, count: int) -> list[float]:
    if value == "sum":
        return [1.0] * count
    if value == "mean":
        return [1.0 / count] * count
    if (
        isinstance(value, list)
        and len(value) == count
        and all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in value)
    ):
        return [float(w) for w in value]
    raise MDTrainError(
        f'model/weights: "sum", "mean" or a list of {count} numbers (one per model), got {value!r}'
    )


def _linear(cfg: dict, base_dir: Path | None) -> CombinedModel:
    type_map = _type_map(cfg, "model")
    models = cfg.get("models")
    if not isinstance(models, list) or not models:
        raise MDTrainError("model/models: a non-empty list of models is required")
    parts, stored_models = [], []
    for k, sub in enumerate(models):
        where = f"model/models/{k}"
        if not isinstance(sub, dict):
            raise MDTrainError(f"{where}: expected a JSON object")
        if sub.get("type_map", type_map) != type_map:
            raise MDTrainError(f"{where}/type_map: must be the parent's {type_map} in mdtrain")
        sub = dict(sub, type_map=type_map)
        if sub.get("type") == "pairtab":
            part, stored = _pairtab(sub, type_map, base_dir, where)
        elif sub.get("type", "standard") == "standard" and "use_srtab" not in sub:
            part = EnergyModel(sub)
            stored = part.get_model_config()
        else:
            raise MDTrainError(f"{where}: only energy models and pairtab models can be combined")
        parts.append(part)
        stored_models.append(stored)
    weights = _weights(cfg.get("weights"), len(parts))
    stored = dict(cfg, models=stored_models)
    return CombinedModel(parts, weights, type_map, stored)


def take_stored_tables(model_config: dict, stored: dict, what: str) -> None:
    """Give each table of ``model_config`` (a ``model`` section, changed in place) the rows
    of the table in the same place of ``stored`` (a checkpoint's or pretrained model's
    section): DeePMD-kit keeps a model's tables in its state, so starting from a model
    starts from its tables. The input's ``rcut`` and ``sel`` stay."""
    pairs = zip(table_sections(model_config), table_sections(stored))
    for (where, key, section), (_, old_key, old) in pairs:
        if old.get(TABLE_ROWS) is None:
            continue
        if section.get(TABLE_ROWS) != old[TABLE_ROWS]:
            log.info("%s: %s.%s: the table of %s", what, where, key, old.get(old_key))
        section[key], section[TABLE_ROWS] = old.get(old_key), old[TABLE_ROWS]


def build_combined_model(model_config: dict, base_dir: str | Path | None = None) -> CombinedModel:
    """The DP+ZBL, ``pairtab`` or ``linear_ener`` model of a ``model`` section."""
    cfg = copy.deepcopy(model_config)
    base = None if base_dir is None else Path(base_dir)
    for key in ("pair_exclude_types", "atom_exclude_types"):
        if cfg.get(key):
            raise MDTrainError(f"model/{key}: not supported with combined models in mdtrain")
    if "use_srtab" in cfg:
        return _zbl(cfg, base)
    if cfg.get("type") == "pairtab":
        type_map = _type_map(cfg, "model")
        part, stored = _pairtab(cfg, type_map, base, "model")
        return CombinedModel([part], [1.0], type_map, stored)
    if cfg.get("type") == "linear_ener":
        return _linear(cfg, base)
    raise MDTrainError(f"model/type: {cfg.get('type')!r} is not a combined model")
