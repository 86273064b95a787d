"""Checks that relate several fields (``rcut_smth < rcut``, one ``sel`` entry per element, ...).

The schema judges each value alone; what only two values together can say wrong lives here.
The checks run on the completed config and tolerate values of the wrong type (the validator
reports those), so every problem is found in one pass.
"""

from __future__ import annotations

import re
from typing import Any

from mdtrain.config.mixed_types import integer_sel_problem, rotation_problem
from mdtrain.config.model_kind import linear_problems, network_sections
from mdtrain.config.precision import committee_problem
from mdtrain.config.wording import show


def cross_checks(config: dict) -> list[str]:
    type_map = _get(config, "model.type_map")
    ntypes = len(type_map) if isinstance(type_map, list) else None
    problems = []
    for where, section in network_sections(config.get("model")):  # a linear_ener's parts too
        desc, fit = section.get("descriptor"), section.get("fitting_net")
        fit = fit if isinstance(fit, dict) else {}
        problems += [
            *_check_descriptor(
                desc if isinstance(desc, dict) else {}, ntypes, f"{where}.descriptor"
            ),
            *_check_fitting(fit, f"{where}.fitting_net"),
            *_check_srtab(section, where),
        ]
    top = network_sections(config.get("model"))
    fit = _get(config, "model.fitting_net") if top == [("model", config.get("model"))] else {}
    if isinstance(fit, dict) and fit.get("type") in ("dipole", "polar"):
        found = rotation_problem(
            _get(config, "model.descriptor"), fit["type"], "model.descriptor", "."
        )
        problems += [found] if found else []
    return [
        *problems,
        *linear_problems(config.get("model")),
        *_check_schedule_and_loss(config),
        *_check_length(config),
        *_check_validating(config),
        *_check_precision(config),
        *_check_model_kind(config, fit if isinstance(fit, dict) else {}),
    ]


def _check_srtab(model: dict, where: str = "model") -> list[str]:
    """``use_srtab`` needs ``sw_rmin < sw_rmax``, as DeePMD-kit's DP+ZBL model does."""
    if "use_srtab" not in model:
        return []
    low, high = model.get("sw_rmin"), model.get("sw_rmax")
    missing = [f"{where}.{k}" for k, v in (("sw_rmin", low), ("sw_rmax", high)) if v is None]
    if missing:
        return [f"{' and '.join(missing)}: required with {where}.use_srtab"]
    if _number(low) and _number(high) and not high > low:
        return [f"{where}.sw_rmax: {show(high)} must be greater than {where}.sw_rmin {show(low)}"]
    return []


def _check_precision(config: dict) -> list[str]:
    value = _get(config, "training.mixed_precision")
    problem = committee_problem(value, _get(config, "training.ensemble"))
    return [problem] if problem else []


# fitting type -> the loss type it trains with (DeePMD-kit's pairing)
_LOSS_OF_FITTING = {
    "ener": "ener",
    "dipole": "tensor",
    "polar": "tensor",
    "dos": "dos",
    "property": "property",
}


def _check_model_kind(config: dict, fit: dict) -> list[str]:
    """The loss suits the fitting; tensor prefactors not both zero; ``atom_exclude_types``
    only for tensor models (the energy model's statistics do not handle it)."""
    kind = fit.get("type", "ener")
    loss = _get(config, "loss")
    loss_type = loss.get("type", "ener") if isinstance(loss, dict) else "ener"
    want = _LOSS_OF_FITTING.get(kind)
    problems = []
    if want and loss_type != want:
        problems.append(
            f"loss.type: a {kind!r} fitting trains with the {want!r} loss, got {loss_type!r}"
        )
    if loss_type == "tensor" and isinstance(loss, dict):
        prefs = (loss.get("pref"), loss.get("pref_atomic"))
        if all(_number(p) for p in prefs) and not any(prefs):
            problems.append(
                "loss: pref and pref_atomic are both 0, so there is nothing to train on"
            )
    if loss_type == "dos" and isinstance(loss, dict) and not dos_terms_on(loss):
        problems.append(
            "loss: no term of the dos loss has both prefactors non-zero (start_pref_x and "
            "limit_pref_x, x in dos, cdf, ados, acdf), so there is nothing to train on"
        )
    excluded = _get(config, "model.atom_exclude_types")
    if kind == "ener" and excluded:
        problems.append(
            f"model.atom_exclude_types: {excluded} is supported for dipole, polar, DOS and "
            "property models only"
        )
    return problems


def dos_terms_on(loss: dict) -> list[str]:
    """The terms of a ``dos`` loss whose two prefactors are non-zero (DeePMD-kit's defaults
    where absent: ados on, the others off)."""
    default = {"dos": 0.0, "cdf": 0.0, "ados": 1.0, "acdf": 0.0}
    return [
        key
        for key, value in default.items()
        if _value(loss.get(f"start_pref_{key}", value)) != 0
        and _value(loss.get(f"limit_pref_{key}", value)) != 0
    ]


def _value(value: Any) -> float:
    return float(value) if _number(value) else 0.0


def _get(config: dict, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_descriptor(desc: dict, ntypes: int | None, where: str = "model.descriptor") -> list[str]:
    members = desc.get("list") if desc.get("type") == "hybrid" else None
    if isinstance(members, list):  # a hybrid: each member by its index
        return [
            problem
            for k, member in enumerate(members)
            if isinstance(member, dict)
            for problem in _check_descriptor(member, ntypes, f"{where}.list[{k}]")
        ]
    problems = []
    rcut, rcut_smth = desc.get("rcut"), desc.get("rcut_smth")
    if _number(rcut) and _number(rcut_smth) and 0 < rcut <= rcut_smth:
        problems.append(f"{where}.rcut_smth: must be smaller than rcut ({rcut}), got {rcut_smth}")

    sel = desc.get("sel")
    if problem := integer_sel_problem(desc, where):
        problems.append(problem)
    if isinstance(sel, list) and ntypes is not None and len(sel) != ntypes:
        problems.append(
            f"{where}.sel: needs one entry per element of model.type_map ({ntypes}), got {len(sel)}"
        )
    ratio = re.fullmatch(r"auto:(.+)", sel) if isinstance(sel, str) else None
    if ratio and _float_or_none(ratio.group(1)) == 0:
        problems.append(f"{where}.sel: the ratio of {show(sel)} must be > 0")

    neuron, axis = desc.get("neuron"), desc.get("axis_neuron")
    last = neuron[-1] if isinstance(neuron, list) and neuron else None
    if isinstance(last, int) and isinstance(axis, int) and 1 <= last < axis:
        problems.append(
            f"{where}.axis_neuron: must not exceed the last neuron width ({last}), got {axis}"
        )

    pairs = desc.get("exclude_types")
    for i, pair in enumerate(pairs if isinstance(pairs, list) and ntypes is not None else []):
        for t in pair if isinstance(pair, list) else []:
            if isinstance(t, int) and not isinstance(t, bool) and t >= ntypes:
                problems.append(
                    f"{where}.exclude_types[{i}]: type {t} is not in model.type_map "
                    f"(types 0..{ntypes - 1})"
                )
    return problems


def _check_fitting(fit: dict, where: str = "model.fitting_net") -> list[str]:
    trainable, neuron = fit.get("trainable"), fit.get("neuron")
    if (
        isinstance(trainable, list)
        and isinstance(neuron, list)
        and len(trainable) != len(neuron) + 1
    ):
        return [
            f"{where}.trainable: needs one entry per layer "
            f"({len(neuron) + 1}: hidden layers and output), got {len(trainable)}"
        ]
    return []


def _check_schedule_and_loss(config: dict) -> list[str]:
    problems = []
    start_lr, stop_lr = (
        _get(config, "learning_rate.start_lr"),
        _get(config, "learning_rate.stop_lr"),
    )
    if _number(start_lr) and _number(stop_lr) and 0 < start_lr < stop_lr:
        problems.append(
            f"learning_rate.stop_lr: must not exceed start_lr ({start_lr}), got {stop_lr}"
        )
    problems += _exclusive(config, "learning_rate", "stop_lr", "stop_lr_ratio")
    problems += _exclusive(config, "learning_rate", "warmup_steps", "warmup_ratio")
    if _get(config, "learning_rate.type") == "wsd" and 0 in (
        stop_lr,
        _get(config, "learning_rate.stop_lr_ratio"),
    ):
        problems.append('learning_rate: type "wsd" needs a stop_lr (or stop_lr_ratio) > 0')

    loss = _get(config, "loss")
    pairs = (
        [
            (loss.get(f"start_pref_{x}", 0), loss.get(f"limit_pref_{x}", 0))
            for x in ("e", "f", "v", "ae", "pf", "gf")
        ]
        if isinstance(loss, dict) and loss.get("type", "ener") == "ener"
        else []
    )
    # a term trains only when both its prefactors are non-zero (DeePMD-kit's PyTorch backend)
    if (
        pairs
        and all(_number(p) for pair in pairs for p in pair)
        and not any(a and b for a, b in pairs)
    ):
        problems.append(
            "loss: no term has both its start_pref and limit_pref non-zero, so there is "
            "nothing to train on"
        )
    if pairs:
        problems += _loss_option_conflicts(loss, pairs)
    return problems


def _loss_option_conflicts(loss: dict, pairs: list) -> list[str]:
    """Options of the ``ener`` loss that DeePMD-kit 3.2 refuses together."""
    on = {x: bool(a and b) for x, (a, b) in zip(("e", "f", "v", "ae", "pf", "gf"), pairs)}
    problems = []
    huber, mae = loss.get("use_huber") is True, loss.get("loss_func") == "mae"
    if loss.get("f_use_norm") is True and not (huber or mae):
        problems.append(
            'loss.f_use_norm: true needs loss.use_huber true or loss.loss_func "mae" '
            "(it chooses what those two take of each atom's force error)"
        )
    if huber:
        clash = [
            name
            for name, used in (
                ("start_pref_pf/limit_pref_pf", on["pf"]),
                ("start_pref_gf/limit_pref_gf", on["gf"]),
                ("relative_f", loss.get("relative_f") is not None),
            )
            if used
        ]
        if clash:
            problems.append(
                f"loss.use_huber: not with loss.{clash[0]} (DeePMD-kit has no Huber loss for "
                "weighted, generalized or relative forces)"
            )
    ncoord = loss.get("numb_generalized_coord", 0)
    if on["gf"] and isinstance(ncoord, int) and ncoord < 1:
        problems.append(
            "loss.numb_generalized_coord: must be >= 1 when loss.start_pref_gf and "
            f"loss.limit_pref_gf are non-zero, got {ncoord}"
        )
    return problems


def _given(value: Any) -> bool:
    """Set to something other than its "unused" value (null, or 0 for ``warmup_steps``)."""
    return value is not None and not (_number(value) and value == 0 and type(value) is int)


def _exclusive(config: dict, section: str, first: str, second: str) -> list[str]:
    """DeePMD-kit's pairs of keys of which at most one may be given."""
    a, b = _get(config, f"{section}.{first}"), _get(config, f"{section}.{second}")
    if _given(a) and _given(b):
        return [
            f"{section}.{first} and {section}.{second} exclude each other: give one of them "
            f"(got {show(a)} and {show(b)})"
        ]
    return []


def _check_length(config: dict) -> list[str]:
    """The length of the training: ``numb_steps`` or ``numb_epoch``, and a warm-up shorter
    than it."""
    training = _get(config, "training")
    if not isinstance(training, dict):
        return []
    steps, epochs = training.get("numb_steps"), training.get("numb_epoch")
    if steps is None and epochs is None:
        return ["training: give numb_steps or numb_epoch (the length of the training)"]
    problems = _exclusive(config, "training", "numb_steps", "numb_epoch")
    warmup = _get(config, "learning_rate.warmup_steps")
    if _number(steps) and _number(warmup) and steps > 0 and warmup >= steps:
        problems.append(
            f"learning_rate.warmup_steps: must be smaller than training.numb_steps ({steps}), "
            f"got {warmup}"
        )
    return problems


def _check_validating(config: dict) -> list[str]:
    """Full validation needs validation data and a metric the loss trains."""
    validating = _get(config, "validating")
    if not isinstance(validating, dict):
        return []
    ema = validating.get("ema_full_validation") and _get(config, "training.enable_ema")
    if not (validating.get("full_validation") or ema) or validating.get("full_val_start") == 1:
        return []
    problems = []
    if not _get(config, "training.validation_data"):
        problems.append("validating.full_validation: needs training.validation_data")
    metric = validating.get("validation_metric")
    loss = _get(config, "loss")
    if isinstance(metric, str) and isinstance(loss, dict):
        term = {"s": "v"}.get(metric[:1].lower(), metric[:1].lower())
        pair = (f"start_pref_{term}", f"limit_pref_{term}")
        if any(_number(loss.get(k)) and loss.get(k) == 0 for k in pair):
            problems.append(
                f"validating.validation_metric: {metric} needs loss.{pair[0]} and "
                f"loss.{pair[1]} both non-zero"
            )
    return problems


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
