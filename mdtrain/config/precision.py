"""What ``training.mixed_precision`` asks for, read from the config alone (no torch: ``mdtrain
check`` uses it and must start fast); what a mode does during a run is in
``mdtrain.train.precision``.

Two forms. mdtrain's strings ``"tf32"``, ``"bf16"``, ``"fp16"`` need float32 networks. DeePMD-kit's
``{"output_prec": ..., "compute_prec": "float16" | "bfloat16"}``: ``output_prec`` (default
``"float32"``) is the precision of the networks' trainable parameters and of what each net
hands back, as DeePMD-kit defines it, so it sets ``model.descriptor.precision`` and
``model.fitting_net.precision`` (`apply_output_prec`).
"""

from __future__ import annotations

from typing import Any

from mdtrain.config.model_kind import network_sections

MODES = ("tf32", "bf16", "fp16")
COMPUTE_PREC = {"bfloat16": "bf16", "float16": "fp16"}  # DeePMD-kit's names -> modes
OUTPUT_PREC = ("float32", "float64")
_PARTS = ("descriptor", "fitting_net")


def mode_of(value: Any) -> str | None:
    """``"tf32"``, ``"bf16"``, ``"fp16"`` or None (off) for a ``training.mixed_precision``
    value: a mode name, or DeePMD-kit's ``{"output_prec": ..., "compute_prec": ...}``."""
    if isinstance(value, dict):
        return COMPUTE_PREC.get(value.get("compute_prec"))
    return value if value in MODES else None


def network_precision(value: Any) -> str:
    """The networks' precision ``value`` needs: DeePMD-kit's ``output_prec``, else float32."""
    if isinstance(value, dict):
        return str(value.get("output_prec", "float32"))
    return "float32"


def _effective(precision: Any) -> Any:
    return "float64" if precision == "default" else precision


def network_problem(value: Any, model_config: dict, where: str) -> str | None:
    """Why the ``training.mixed_precision`` ``value`` cannot train this model (its networks
    must have `network_precision`), or None."""
    mode = mode_of(value)
    if mode is None:
        return None
    want = network_precision(value)
    wrong = [
        (f"{path}.{part}.precision", _effective(section[part].get("precision", "default")))
        for path, section in network_sections(model_config)
        for part in _PARTS
        if isinstance(section.get(part), dict)
        and _effective(section[part].get("precision", "default")) != want
    ]
    if not wrong:
        return None
    names = " and ".join(name for name, _ in wrong)
    return f'{where} "{mode}" needs {want} networks: set {names} to "{want}" ({wrong[0][1]} now)'


def apply_output_prec(config: dict) -> list[str]:
    """DeePMD-kit's form sets the networks' precision to its ``output_prec`` (filled with
    "float32" when absent); a precision given explicitly otherwise is a conflict, one line."""
    value = (config.get("training") or {}).get("mixed_precision")
    model = config.get("model")
    if not isinstance(value, dict) or not isinstance(model, dict):
        return []
    want = value.setdefault("output_prec", "float32")
    if want not in OUTPUT_PREC or value.get("compute_prec") not in COMPUTE_PREC:
        return []  # the schema reports it
    problems = []
    for path, section in network_sections(model):
        for part in _PARTS:
            net = section.get(part)
            if not isinstance(net, dict):
                continue
            given = net.get("precision", "default")
            if given in ("default", want):
                net["precision"] = want
            else:
                problems.append(
                    f'{path}.{part}.precision: "{given}" conflicts with '
                    f'training.mixed_precision.output_prec "{want}" (the networks\' precision)'
                )
    return problems


def committee_problem(value: Any, ensemble: Any) -> str | None:
    """float16's loss scaling steps one model: refused for a committee (one line)."""
    if mode_of(value) == "fp16" and isinstance(ensemble, int) and ensemble > 1:
        return (
            'training.mixed_precision "fp16" (its loss scaling) trains one model, not a '
            f'committee (training.ensemble {ensemble}); use "bf16"'
        )
    return None
