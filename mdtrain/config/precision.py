"""What ``training.mixed_precision`` asks for, read from the config alone (no torch: ``mdtrain
check`` uses it and must start fast); what a mode does during a run is in
``mdtrain.train.precision``."""

from __future__ import annotations

from typing import Any

MODES = ("tf32", "bf16")


def mode_of(value: Any) -> str | None:
    """``"tf32"``, ``"bf16"`` or None (off) for a ``training.mixed_precision`` value: a mode
    name, or DeePMD's ``{"output_prec": "float32", "compute_prec": "bfloat16"}``."""
    if isinstance(value, dict):
        return "bf16" if value.get("compute_prec") == "bfloat16" else None
    return value if value in MODES else None


def network_problem(mode: str | None, model_config: dict, where: str) -> str | None:
    """Why ``mode`` cannot train this model (its networks must be float32), or None."""
    if mode is None:
        return None
    wide = [
        f"model.{part}.precision"
        for part in ("descriptor", "fitting_net")
        if isinstance(model_config.get(part), dict)
        and model_config[part].get("precision", "default") in ("default", "float64")
    ]
    if not wide:
        return None
    return (
        f'{where} "{mode}" needs float32 networks: set {" and ".join(wide)} to "float32" '
        "(float64 now)"
    )
