"""Which implementation of the model runs: chosen once, here, when a model is built.

Backends, in the order they are tried:

1. ``kernels``: explicit first-order derivatives, the embedding net on the compiled C++ kernels
   (``mdtrain.model.accel.kernel_nodes``): tanh networks, float32/float64, CPU tensors, and a
   C++ compiler on the machine;
2. ``fused``: the same maths on fused PyTorch autograd nodes (``accel.embedding_nodes``), on
   any device: tanh networks, float32/float64;
3. ``reference``: the plain model (``mdtrain.model.energy``): forces by autograd, any
   activation; the one TorchScript and bf16/fp16 mixed precision use, and the one every other
   backend is tested against.

``MDTRAIN_BACKEND`` (or the ``backend`` argument) forces one; a forced backend that cannot run
this model is an error, never a silent fallback. All backends share the reference model's
parameters and buffers, so a checkpoint does not depend on the backend that wrote it.
"""

from __future__ import annotations

import logging
import os

import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.accel.committee import ExplicitCommittee
from mdtrain.model.accel.embedding_nodes import TorchEmbedding
from mdtrain.model.accel.explicit import FORMS, ExplicitEnergyModel
from mdtrain.model.accel.explicit_hybrid import ExplicitHybridModel
from mdtrain.model.accel.kernel_nodes import KernelEmbedding
from mdtrain.model.accel.kernels import load_kernels
from mdtrain.model.accel.pair_kernels import CompiledPairs
from mdtrain.model.autocast import COMPUTE_DTYPES, compute_mode, use_low_precision
from mdtrain.model.combined import CombinedModel
from mdtrain.model.combined_build import build_combined_model, is_combined
from mdtrain.model.committee import Committee
from mdtrain.model.config import normalize_model_config
from mdtrain.model.energy import EnergyModel
from mdtrain.model.fittings.config import TENSOR_TYPES
from mdtrain.model.fittings.invariant_config import INVARIANT_TYPES
from mdtrain.model.invariant import InvariantModel
from mdtrain.model.tensor import TensorModel

log = logging.getLogger("mdtrain.model")

BACKENDS = ("kernels", "fused", "reference")
# The descriptors the explicit-derivative backends implement, alone or as every member of a
# hybrid; every other runs the reference.
ACCELERATED_DESCRIPTORS = tuple(FORMS)
BACKEND_ENV = "MDTRAIN_BACKEND"
_announced: set[str] = set()


def explicit_problem(config: dict, mixed_precision: str | None) -> str | None:
    """Why the explicit-derivative backends cannot run this model, or None."""
    desc, fit = config["descriptor"], config["fitting_net"]
    parts = [("descriptor", desc)]
    if desc["type"] == "hybrid":  # each member on its own form (``accel.explicit_hybrid``)
        parts = [(f"descriptor.list[{k}]", m) for k, m in enumerate(desc["list"])]
    for where, part in parts:
        if part["type"] not in ACCELERATED_DESCRIPTORS:
            accelerated = ", ".join(ACCELERATED_DESCRIPTORS) + ", a hybrid of them"
            return f"model.{where}.type is {part['type']!r} (accelerated: {accelerated})"
    for where, part in (*parts, ("fitting_net", fit)):
        if part["activation_function"] != "tanh":
            return (
                f"model.{where}.activation_function is {part['activation_function']!r} (needs tanh)"
            )
    if fit.get("numb_fparam", 0) or fit.get("numb_aparam", 0):
        return "frame/atomic parameters (numb_fparam, numb_aparam) run the reference model"
    if mixed_precision in COMPUTE_DTYPES:
        return f"{mixed_precision} mixed precision runs the reference model"
    return None


def choose_backend(
    config: dict,
    device: torch.device,
    mixed_precision: str | None = None,
    forced: str | None = None,
) -> tuple[str, str]:
    """(backend name, why) for a normalised model config on ``device``; ``forced`` None reads
    ``MDTRAIN_BACKEND`` ("auto" or unset: the first that can run)."""
    choice = (forced or os.environ.get(BACKEND_ENV, "") or "auto").strip().lower()
    if choice not in ("auto", *BACKENDS):
        raise MDTrainError(f"{BACKEND_ENV}={choice!r} is not one of auto, {', '.join(BACKENDS)}")
    if choice != "auto":
        problem = _problem(choice, config, device, mixed_precision)
        if problem:
            raise MDTrainError(f"model backend {choice!r} cannot run here: {problem}")
        return choice, "forced"
    skipped = []
    for name in BACKENDS:  # in order, so the kernels are only loaded when they would be used
        problem = _problem(name, config, device, mixed_precision)
        if problem is None:
            return name, "; ".join(skipped) or "first choice"
        skipped.append(f"{name}: {problem}")
    raise AssertionError("the reference backend always runs")


def _problem(
    name: str, config: dict, device: torch.device, mixed_precision: str | None
) -> str | None:
    """Why backend ``name`` cannot run this model on ``device``, or None."""
    if name == "reference":
        return None
    explicit = explicit_problem(config, mixed_precision)
    if explicit or name == "fused":
        return explicit
    return _kernel_problem(device)


def build_model(
    model_config: dict,
    device: str | torch.device = "cpu",
    mixed_precision: str | None = None,
    backend: str | None = None,
) -> EnergyModel:
    """The model for ``model_config`` on ``device``, with the fastest backend that can run it
    (see the module docstring); ``model.backend`` names the one chosen."""
    device = torch.device(device)
    if is_combined(model_config):
        return _combined_model(model_config, device, mixed_precision, backend)
    config = normalize_model_config(model_config)
    if config["fitting_net"]["type"] in TENSOR_TYPES:  # no accelerated tensor fittings yet
        if (backend or "reference") != "reference" or mixed_precision == "bf16":
            raise MDTrainError("dipole and polar models run on the reference backend, float64/32")
        return TensorModel(config).to(device)
    if config["fitting_net"]["type"] in INVARIANT_TYPES:  # no accelerated fittings of these
        if (backend or "reference") != "reference" or mixed_precision in COMPUTE_DTYPES:
            raise MDTrainError("DOS and property models run on the reference backend, float64/32")
        return InvariantModel(config).to(device)
    name, why = choose_backend(config, device, mixed_precision, backend)
    explicit = (
        ExplicitHybridModel if config["descriptor"]["type"] == "hybrid" else ExplicitEnergyModel
    )
    if name == "kernels":
        kernels = load_kernels()
        model = explicit(config, KernelEmbedding(kernels), CompiledPairs(kernels))
    elif name == "fused":
        model = explicit(config, TorchEmbedding())
    else:
        model = EnergyModel(config)
    if mixed_precision in COMPUTE_DTYPES:
        use_low_precision(model, mixed_precision)
    if name not in _announced:
        _announced.add(name)
        detail = f", products on {load_kernels().blas}" if name == "kernels" else ""
        log.info("model backend: %s%s (%s)", name, detail, why)
    return model.to(device)


def _combined_model(
    model_config: dict, device: torch.device, mixed_precision: str | None, backend: str | None
) -> CombinedModel:
    """A table or combined model (``model.combined_build``): the reference maths only."""
    forced = (backend or os.environ.get(BACKEND_ENV, "") or "auto").strip().lower()
    if forced not in ("auto", "reference"):
        raise MDTrainError(f"backend {forced!r}: a model with a pair table runs on 'reference'")
    if mixed_precision in COMPUTE_DTYPES:
        raise MDTrainError(
            f"training.mixed_precision {mixed_precision}: not supported with a pair table"
        )
    return build_combined_model(model_config).to(device)


def build_committee(
    model_configs: list[dict],
    device: str | torch.device = "cpu",
    mixed_precision: str | None = None,
    backend: str | None = None,
) -> Committee:
    """The members built from ``model_configs`` (one architecture, different seeds:
    ``mdtrain.model.committee.member_model_config``) as one committee, each with the backend
    ``build_model`` chooses. On the explicit-derivative backends the committee computes the
    members' shared environment once (``accel.committee``); on the reference each member runs
    alone."""
    members = [build_model(c, device, mixed_precision, backend) for c in model_configs]
    if len({m.backend for m in members}) != 1:
        raise MDTrainError("committee members would run on different backends")
    first = members[0]
    if isinstance(first, ExplicitEnergyModel) and first.descriptor.type_name == "se_e2_a":
        return ExplicitCommittee(members)  # its shared environment is se_e2_a's
    return Committee(members)


def build_models(
    model_configs: list[dict],
    device: str | torch.device = "cpu",
    mixed_precision: str | None = None,
    backend: str | None = None,
) -> torch.nn.Module:
    """What a run of ``len(model_configs)`` models trains: the one model itself (a single
    run), or their committee."""
    if len(model_configs) == 1:
        return build_model(model_configs[0], device, mixed_precision, backend)
    return build_committee(model_configs, device, mixed_precision, backend)


def to_device(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """``model`` on ``device``: moved, or, for a backend that cannot run there (the compiled
    kernels take CPU tensors), rebuilt for the device with the same weights and mode."""
    device = torch.device(device)
    if not isinstance(model, EnergyModel) or model.backend != "kernels" or device.type == "cpu":
        return model.to(device)
    rebuilt = build_model(model.get_model_config(), device)
    rebuilt.load_state_dict(model.state_dict())
    return rebuilt.train(model.training)


def as_reference(model: EnergyModel) -> EnergyModel:
    """The reference model with ``model``'s parameters and buffers (for TorchScript)."""
    if isinstance(model, CombinedModel):  # its parts run the reference maths only
        return model
    if type(model) is EnergyModel and compute_mode(model) is None:
        return model
    if isinstance(model, (InvariantModel, TensorModel)):
        return model  # these run the reference model only
    reference = EnergyModel(model.get_model_config())
    reference.load_state_dict(model.state_dict())
    return reference.to(next(model.buffers()).device).train(model.training)


def _kernel_problem(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"the kernels take CPU tensors (device {device})"
    try:
        load_kernels()
    except RuntimeError as exc:
        if "kernels-unavailable" not in _announced:
            _announced.add("kernels-unavailable")
            log.warning("compiled embedding kernels unavailable (%s); using PyTorch ops", exc)
        return f"compiled kernels unavailable ({exc})"
    return None
