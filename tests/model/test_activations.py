"""Activation functions with DeePMD-kit's PyTorch-backend meanings: each name against its
formula, "gelu" as the tanh approximation in new models (stored unambiguously as "gelu_tf"),
old stored configs' "gelu" as the exact erf form, and every name through a model, its force
loss gradient and TorchScript."""

from __future__ import annotations

import math

import pytest
import torch

from mdtrain.model import EnergyModel
from mdtrain.model.config import normalize_model_config, stored_model_config
from mdtrain.model.network import ACTIVATIONS, activate
from mdtrain.schema import load_schema
from tests.helpers.models import batch, set_random_stats, small_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit's notices

X = torch.linspace(-7.0, 7.0, 141, dtype=torch.float64)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


FORMULAS = {
    "tanh": torch.tanh,
    "relu": lambda x: torch.where(x > 0, x, 0.0),
    "relu6": lambda x: torch.clamp(torch.where(x > 0, x, 0.0), max=6.0),
    "softplus": lambda x: torch.log1p(torch.exp(x)),
    "sigmoid": lambda x: 1 / (1 + torch.exp(-x)),
    "silu": lambda x: x / (1 + torch.exp(-x)),
    "gelu": gelu_tanh,
    "gelu_tf": gelu_tanh,
    "gelu_erf": gelu_erf,
    "linear": lambda x: x,
    "none": lambda x: x,
}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_each_name_is_its_formula(name):
    torch.testing.assert_close(activate(X, name), FORMULAS[name](X), rtol=1e-12, atol=1e-12)


def test_the_two_gelu_forms_differ():
    # so that the tests telling them apart below can fail
    assert (gelu_tanh(X) - gelu_erf(X)).abs().max() > 1e-4


def test_schema_accepts_exactly_the_implemented_names():
    node = load_schema()["$defs"]["activation_function"]
    assert set(node["enum"]) == set(ACTIVATIONS)
    assert node["x-value-aliases"] == {"None": "none"}


def test_new_gelu_is_stored_as_the_tanh_form_and_computes_it():
    cfg = small_config({"activation_function": "gelu"}, {"activation_function": "gelu"})
    norm = normalize_model_config(cfg)
    assert norm["descriptor"]["activation_function"] == "gelu_tf"
    assert norm["fitting_net"]["activation_function"] == "gelu_tf"
    model = EnergyModel(cfg)
    assert {layer.activation for layer in model.descriptor.networks[0].layers} == {"gelu_tf"}
    # the same weights with each form: "gelu" gives the tanh form's energies, not erf's
    energies = {}
    for name in ("gelu", "gelu_tf", "gelu_erf"):
        other = set_random_stats(EnergyModel(small_config({"activation_function": name})))
        energies[name] = other(*batch(other))["energy"].detach()
    torch.testing.assert_close(energies["gelu"], energies["gelu_tf"], rtol=0, atol=0)
    assert (energies["gelu"] - energies["gelu_erf"]).abs().max() > 1e-8


def test_stored_gelu_of_an_old_config_is_the_erf_form():
    old = small_config({"activation_function": "gelu"}, {"activation_function": "gelu"})
    stored = stored_model_config(old)
    assert stored["descriptor"]["activation_function"] == "gelu_erf"
    assert stored["fitting_net"]["activation_function"] == "gelu_erf"
    assert old["descriptor"]["activation_function"] == "gelu"  # a copy, the input untouched
    # a normalised config (what new checkpoints hold) passes through unchanged
    new = normalize_model_config(small_config({"activation_function": "gelu"}))
    assert stored_model_config(new) == new
    assert "activation_function" not in stored_model_config({"descriptor": {}})["descriptor"]


@pytest.mark.parametrize("name", ["relu6", "silu", "gelu", "gelu_erf", "none"])
def test_every_name_trains_forces_and_scripts(name):
    model = set_random_stats(
        EnergyModel(small_config({"activation_function": name}, {"activation_function": name}))
    )
    inputs = batch(model)
    out = model.train()(*inputs)
    # the force loss needs the derivative of the forces with respect to the parameters
    out["force"].square().sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.eval()
    scripted = torch.jit.script(model)
    ref = model(*inputs)
    got = scripted(*inputs)
    torch.testing.assert_close(got["energy"], ref["energy"], rtol=0, atol=1e-12)
    torch.testing.assert_close(got["force"], ref["force"], rtol=0, atol=1e-12)
