"""An input without ``model.type_map``, as DeePMD-kit accepts it: the model's types are the
indices written in ``type.raw``. The number of types is then the length of the descriptor's
``sel`` list; the names, unknown, become ``type_0``, ``type_1``, ... (with a warning), so that
everything downstream (statistics, checkpoints, ``.dp`` files) has a type_map to carry."""

from __future__ import annotations

import copy
import logging
from typing import Any

from mdtrain.config.model_kind import STANDARD, model_type

log = logging.getLogger("mdtrain.config")

PLACEHOLDER = "type_{}"


def fill_type_map(config: dict, problems: list[str]) -> dict:
    """``config`` with placeholder type names when ``model.type_map`` is absent; a problem
    when the number of types cannot be told from ``sel`` (``"auto"`` or one integer)."""
    model = config.get("model")
    if not isinstance(model, dict) or "type_map" in model:
        return config
    if model_type(model) != STANDARD:
        problems.append(f"model.type_map: required with model.type {model_type(model)!r}")
        return config
    desc = model.get("descriptor")
    sel: Any = desc.get("sel") if isinstance(desc, dict) else None
    if not (isinstance(sel, list) and sel and all(isinstance(s, int) for s in sel)):
        problems.append(
            "model.type_map: missing; without it the types are the indices of type.raw and "
            "their number is the length of descriptor.sel, which must then be a list"
        )
        return config
    out = copy.deepcopy(config)
    out["model"]["type_map"] = [PLACEHOLDER.format(t) for t in range(len(sel))]
    log.warning(
        "model.type_map is not given: the %d type(s) are the indices of type.raw, named %s "
        "(element names unknown)",
        len(sel),
        ", ".join(out["model"]["type_map"]),
    )
    return out
