"""Which descriptors a dipole or polar fitting takes, as DeePMD-kit decides it: those with a
rotation matrix (se_e2_a, se_atten, se_atten_v2, and hybrids whose members all have one,
type-mixed ones included); any other is one line naming the key, a hybrid's member by its
index, from ``mdtrain check`` and from the model alike. A trained type-mixed tensor model
restarts exactly."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.config.mixed_types import ROTATION_DESCRIPTORS
from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors import DESCRIPTORS
from mdtrain.model.tensor import TensorModel
from tests.helpers.descriptor_battery import battery_config
from tests.helpers.models import TENSOR_DESCRIPTORS, make_tensor_model
from tests.helpers.training import lcurve_rows, load_params, make_tensor_project

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*deprecated:DeprecationWarning")


def test_the_config_layers_rotation_list_agrees_with_the_registry():
    """``ROTATION_DESCRIPTORS`` (read by ``mdtrain check`` without the models) names exactly
    the registered single descriptors with ``forward_with_rot``, by every name and alias."""
    single = [c for c in DESCRIPTORS.values() if c.members_key is None]
    with_rot = {
        n for c in single if hasattr(c, "forward_with_rot") for n in (c.type_name, *c.aliases)
    }
    assert set(ROTATION_DESCRIPTORS) == with_rot


@pytest.mark.parametrize("descriptor", list(TENSOR_DESCRIPTORS))
def test_embedding_width_is_the_rotation_matrix_width(descriptor):
    """DeePMD-kit's ``embedding_width`` = ``get_dim_emb()``: the last embedding width, a
    hybrid's summed over its members; the fitting is one net for all types after a type-mixed
    descriptor."""
    model = make_tensor_model("dipole", descriptor=descriptor)
    desc = TENSOR_DESCRIPTORS[descriptor] or {"neuron": [16]}
    members = desc.get("list", [desc])
    assert model.fitting.embedding_width == sum(m["neuron"][-1] for m in members)
    assert (len(model.fitting.nets.networks) == 1) is model.mixed_types
    x = torch.randn(1, 4, 40, 3, dtype=torch.float64)
    nlist = torch.full((1, 4, model.descriptor.nnei), -1)
    nlist[..., :3] = torch.tensor([1, 2, 3])
    d, gr = model.descriptor.forward_with_rot(
        x[:, :, : model.descriptor.nnei], nlist, torch.tensor([0, 1, 1, 0])
    )
    assert gr.shape == (1, 4, model.fitting.embedding_width, 3)
    assert d.shape[-1] == model.descriptor.dim_out


REFUSED = {
    "se_e3_tebd": ("model.descriptor.type", battery_config("se_e3_tebd")["descriptor"]),
    "se_e2_r": ("model.descriptor.type", battery_config("se_e2_r")["descriptor"]),
    "hybrid": (
        "model.descriptor.list[1].type",
        {
            "type": "hybrid",
            "list": [TENSOR_DESCRIPTORS["se_atten"], battery_config("se_e3")["descriptor"]],
        },
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
@pytest.mark.parametrize("kind", ["dipole", "polar"])
def test_a_descriptor_without_rotation_matrix_is_one_line(tmp_path, capsys, name, kind):
    where, desc = REFUSED[name]
    inp = make_tensor_project(tmp_path, kind, numb_steps=2, descriptor=desc)
    assert main(["check", str(inp)]) != 0
    err = "".join(capsys.readouterr())
    assert f"{where}: " in err and "gives no rotation matrix" in err and f"a {kind} fitting" in err
    cfg = json.loads(inp.read_text())["model"]
    cfg["descriptor"] = copy.deepcopy(desc)
    for section in cfg["descriptor"].get("list", [cfg["descriptor"]]):
        section["sel"] = section.get("sel", 10)
    with pytest.raises(MDTrainError) as info:
        TensorModel(cfg)
    message = str(info.value)
    assert message.startswith(where.replace(".", "/") + ": ") and "\n" not in message


@pytest.mark.parametrize("descriptor", ["se_atten", "hybrid-mixed"])
def test_a_type_mixed_tensor_training_restarts_exactly(tmp_path, descriptor):
    """With the statistics (``sel: "auto"`` per member): a run resumed from its middle
    checkpoint ends with the same parameters and learning curve, bit for bit."""
    import os

    desc = copy.deepcopy(TENSOR_DESCRIPTORS[descriptor])
    for section in desc.get("list", [desc]):
        section["sel"] = "auto"
    inp = make_tensor_project(tmp_path, "polar", numb_steps=6, descriptor=desc)
    config = json.loads(inp.read_text())
    config["training"].update(save_freq=3, disp_freq=1)
    inp.write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["train", str(inp), "-o", str(out)]) == 0
    full = load_params(out / "model.ckpt-6.pt")
    rows = lcurve_rows(out / "lcurve.out")
    assert np.isfinite(rows[:, 1]).all()  # (a batch without a label: nan in its columns)
    os.remove(out / "model.ckpt-6.pt")
    assert main(["train", str(inp), "-o", str(out), "--restart", str(out / "model.ckpt-3.pt")]) == 0
    again = load_params(out / "model.ckpt-6.pt")
    for key in full:
        assert torch.equal(full[key], again[key]), key
    np.testing.assert_array_equal(lcurve_rows(out / "lcurve.out"), rows)
