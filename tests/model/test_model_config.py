"""The model section: defaults filled, bad values named by key, aliases, seeded initialisation."""

from __future__ import annotations

import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model import EnergyModel
from tests.helpers.models import small_config


def test_missing_defaults_are_filled():
    model = EnergyModel({"type_map": ["A"], "descriptor": {"sel": [5]}, "fitting_net": {}})
    cfg = model.get_model_config()
    assert cfg["descriptor"]["neuron"] == [10, 20, 40]
    assert cfg["descriptor"]["axis_neuron"] == 4
    assert cfg["descriptor"]["type_one_side"] is False
    assert cfg["fitting_net"]["neuron"] == [120, 120, 120]
    assert cfg["fitting_net"]["resnet_dt"] is True
    assert model.rcut == 6.0 and model.sel == [5] and model.type_map == ["A"]
    rebuilt = EnergyModel(cfg)
    assert rebuilt.get_model_config() == cfg


@pytest.mark.parametrize(
    "change, match",
    [
        ({"descriptor": {"sel": "auto"}}, "sel"),
        ({"descriptor": {"sel": [3]}}, "sel"),
        ({"descriptor": {"rcut_smth": 4.0}}, "rcut_smth"),
        ({"descriptor": {"precision": "float16"}}, "precision"),
        ({"descriptor": {"activation_function": "swish"}}, "activation_function"),
        ({"fitting_net": {"numb_fparam": 2, "default_fparam": [1.0]}}, "default_fparam"),
        ({"descriptor": {"exclude_types": [[0, 5]]}}, "exclude_types"),
    ],
)
def test_bad_config_names_the_key(change, match):
    cfg = small_config(change.get("descriptor"), change.get("fitting_net"))
    with pytest.raises(MDTrainError, match=match):
        EnergyModel(cfg)


def test_aliases_and_seeded_init_reproducible():
    cfg = small_config()
    cfg["descriptor"]["n_axis_neuron"] = cfg["descriptor"].pop("axis_neuron")
    a, b = EnergyModel(cfg), EnergyModel(cfg)
    assert a.descriptor.axis_neuron == 4
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    other = EnergyModel(small_config({"seed": 7}))
    w_a = a.descriptor.networks[0].layers[0].weight
    w_o = other.descriptor.networks[0].layers[0].weight
    assert not torch.equal(w_a, w_o)
