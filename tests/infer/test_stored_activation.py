"""Models written before "gelu" followed DeePMD-kit (the tanh form) keep the exact erf form they
were trained with: an old checkpoint's or frozen model's ``"gelu"`` loads as ``"gelu_erf"``
and gives the energies it gave before, through every way of loading it."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from mdtrain.infer.freeze import freeze_model
from mdtrain.infer.load import FROZEN_METADATA, load_model, read_frozen_metadata
from mdtrain.model import EnergyModel
from mdtrain.model.files import load_checkpoint
from tests.helpers.models import TINY_CONFIG, batch, save_tiny_checkpoint, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*deprecated:DeprecationWarning")


def config_with(name: str) -> dict:
    cfg = copy.deepcopy(TINY_CONFIG)
    cfg["descriptor"]["activation_function"] = name
    cfg["fitting_net"]["activation_function"] = name
    return cfg


def old_style(model: EnergyModel) -> dict:
    """``model``'s config as mdtrain wrote it before: the exact form was called "gelu"."""
    cfg = model.get_model_config()
    for part in ("descriptor", "fitting_net"):
        assert cfg[part]["activation_function"] == "gelu_erf"
        cfg[part]["activation_function"] = "gelu"
    return cfg


@pytest.fixture(scope="module")
def erf_model() -> EnergyModel:
    return tiny_model(config=config_with("gelu_erf"))


def energies(model: torch.nn.Module, inputs: tuple) -> torch.Tensor:
    with torch.enable_grad():
        return model(*inputs)["energy"].detach()


def test_old_checkpoint_keeps_the_erf_form_and_its_energies(tmp_path, erf_model):
    path = save_tiny_checkpoint(tmp_path / "old.pt", erf_model)
    state = torch.load(path, weights_only=True)
    state["model_config"] = old_style(erf_model)
    torch.save(state, path)

    assert load_checkpoint(path)["model_config"]["fitting_net"]["activation_function"] == (
        "gelu_erf"
    )
    inputs = batch(erf_model)
    before = energies(erf_model, inputs)  # what the model gave when it was written
    loaded = load_model(path)
    torch.testing.assert_close(energies(loaded, inputs), before, rtol=0, atol=1e-12)
    # the same weights read with today's "gelu" (tanh) would give other energies
    tanh_model = EnergyModel(config_with("gelu"))
    tanh_model.load_state_dict(erf_model.state_dict())
    assert (energies(tanh_model, inputs) - before).abs().max() > 1e-8


def test_old_frozen_model_keeps_the_erf_form_eager_and_scripted(tmp_path, erf_model):
    path = tmp_path / "old.pth"
    freeze_model(erf_model, path)
    # rewrite the metadata as an earlier mdtrain wrote it ("gelu" for the erf form)
    extra = {FROZEN_METADATA: ""}
    module = torch.jit.load(str(path), _extra_files=extra)
    metadata = json.loads(extra[FROZEN_METADATA])
    metadata["model_config"] = old_style(erf_model)
    torch.jit.save(module, str(path), _extra_files={FROZEN_METADATA: json.dumps(metadata)})

    assert read_frozen_metadata(path)["model_config"]["descriptor"]["activation_function"] == (
        "gelu_erf"
    )
    inputs = batch(erf_model)
    before = energies(erf_model, inputs)
    eager = load_model(path)
    assert isinstance(eager, EnergyModel)
    torch.testing.assert_close(energies(eager, inputs), before, rtol=0, atol=1e-12)
    scripted = load_model(path, scripted=True)
    torch.testing.assert_close(energies(scripted, inputs), before, rtol=0, atol=1e-12)


def test_new_checkpoint_stores_gelu_as_the_tanh_form(tmp_path):
    model = tiny_model(config=config_with("gelu"))
    path = save_tiny_checkpoint(tmp_path / "new.pt", model)
    assert load_checkpoint(path)["model_config"]["descriptor"]["activation_function"] == "gelu_tf"
    inputs = batch(model)
    torch.testing.assert_close(
        energies(load_model(path), inputs), energies(model, inputs), rtol=0, atol=1e-12
    )
