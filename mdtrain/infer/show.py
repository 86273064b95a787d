"""What ``mdtrain show MODEL ATTRIBUTES...`` prints about a model (DeePMD-kit's ``dp show``):
one block of lines per attribute, worded as ``dp show`` logs them, so that scripts reading
its output find the same lines.

Attributes: DeePMD-kit 3.2's ``type-map``, ``descriptor``, ``fitting-net``, ``size``
(parameter counts: names holding ``descriptor``, then ``fitting``), ``observed-type`` (the
types whose energy bias is not zero, DeePMD-kit's rule for a model without that record),
``model-branch`` (refused: these models are single-task), and mdtrain's ``rcut`` and ``sel``.
DeePMD-kit's ``serialization-tree`` is refused with a pointer to ``dp show`` on the ``.dp``
file (it prints DeePMD-kit's own object tree).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mdtrain.errors import MDTrainError

ATTRIBUTES = (
    "model-branch",
    "type-map",
    "descriptor",
    "fitting-net",
    "size",
    "observed-type",
    "rcut",
    "sel",
)
DEFAULT = ("type-map", "descriptor", "fitting-net", "size", "rcut", "sel")


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Trainable and frozen parameters of the descriptor, the fitting net and both."""
    named = dict(model.named_parameters())
    descriptor = sum(p.numel() for k, p in named.items() if "descriptor" in k)
    fitting = sum(p.numel() for k, p in named.items() if "fitting" in k)
    return {"descriptor": descriptor, "fitting-net": fitting, "total": descriptor + fitting}


def observed_types(model: torch.nn.Module) -> list[str]:
    """Elements of the type_map whose energy bias is non-zero (seen by the statistics)."""
    bias = model.out_bias.detach().cpu().tolist()
    return [t for t, b in zip(model.type_map, bias, strict=True) if abs(b) > 1e-6]


def _size(model: torch.nn.Module) -> list[str]:
    counts = parameter_counts(model)
    return ["Parameter counts:"] + [f"Parameters in {k}: {counts[k]:,}" for k in sorted(counts)]


def _observed(model: torch.nn.Module) -> list[str]:
    seen = observed_types(model)
    return [
        "The observed types for this model: ",
        f"Number of observed types: {len(seen)} ",
        f"Observed types: {seen} ",
    ]


def _model_branch(model: torch.nn.Module) -> list[str]:
    raise MDTrainError(
        "show: the 'model-branch' attribute needs a multitask model; this one is single-task"
    )


_LINES: dict[str, Callable[[torch.nn.Module], list[str]]] = {
    "model-branch": _model_branch,
    "type-map": lambda m: [f"The type_map is {list(m.type_map)}"],
    "descriptor": lambda m: [f"The descriptor parameter is {m.get_model_config()['descriptor']}"],
    "fitting-net": lambda m: [
        f"The fitting_net parameter is {m.get_model_config()['fitting_net']}"
    ],
    "size": _size,
    "observed-type": _observed,
    "rcut": lambda m: [f"The rcut is {float(m.rcut)}"],
    "sel": lambda m: [f"The sel is {[int(s) for s in m.sel]}"],
}


def describe(model: torch.nn.Module, attributes: list[str]) -> list[str]:
    """The lines ``dp show`` would print for ``attributes`` (in ``dp show``'s order)."""
    if "serialization-tree" in attributes:
        raise MDTrainError(
            "show: 'serialization-tree' prints DeePMD-kit's own object tree: freeze the model "
            "to .dp and run dp show on it"
        )
    unknown = [a for a in attributes if a not in _LINES]
    if unknown:
        raise MDTrainError(
            f"show: unknown attribute {unknown[0]!r}; choose from {', '.join(ATTRIBUTES)}"
        )
    lines = ["This is a singletask model"]
    for name in ATTRIBUTES:
        if name in attributes:
            lines += _LINES[name](model)
    return lines
