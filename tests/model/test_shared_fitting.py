"""One fitting net for all atom types after a type-mixed descriptor (DeePMD-kit's fitting
``mixed_types``): the rule, the nets of several outputs (dipole, polar), frame and atomic
parameters, the ``.dp`` forms, and the refusals of what does not follow the rule (old
checkpoints with one net per type, files whose fitting is not their descriptor's)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mdtrain.config import shares_fitting_net
from mdtrain.errors import MDTrainError
from mdtrain.model import EnergyModel
from mdtrain.model.deepmd_format import deepmd_to_model, model_to_deepmd
from mdtrain.model.deepmd_nets import Reader
from mdtrain.model.files import load_checkpoint
from mdtrain.model.fitting import EnergyFitting
from mdtrain.model.fittings.deepmd_io import fitting_from_deepmd, fitting_to_deepmd
from mdtrain.model.fittings.dipole import DipoleFitting
from mdtrain.model.fittings.nets import TypeFittingNets
from tests.helpers.descriptor_battery import battery_config
from tests.helpers.models import evaluate, save_tiny_checkpoint, set_random_stats, water_like

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*deprecated:DeprecationWarning")


def test_the_rule_is_deepmd_kits():
    """The descriptor's ``mixed_types()``; a hybrid's is True when any member's is."""
    assert shares_fitting_net({"type": "se_atten"}) and shares_fitting_net({"type": "dpa1"})
    assert shares_fitting_net({"type": "se_atten_v2"}) and shares_fitting_net(
        {"type": "se_e3_tebd"}
    )
    for kind in ("se_e2_a", "se_a", "se_e2_r", "se_e3", "se_at"):
        assert not shares_fitting_net({"type": kind})
    per_type = {"type": "hybrid", "list": [{"type": "se_e2_a"}, {"type": "se_e2_r"}]}
    assert not shares_fitting_net(per_type)
    mixed = copy.deepcopy(per_type)
    mixed["list"][1] = {"type": "se_atten"}
    assert shares_fitting_net(mixed)


def test_shared_nets_of_several_outputs_keep_the_bias_and_exclusions_per_type():
    torch.manual_seed(0)
    nets = TypeFittingNets(3, 5, 4, [6, 6], seed=1, exclude_types=[2], mixed_types=True)
    assert len(nets.networks) == 1
    with torch.no_grad():
        nets.bias_atom_e.copy_(torch.randn(3, 4, dtype=torch.float64))
    d = torch.randn(2, 4, 5, dtype=torch.float64)
    atype = torch.tensor([1, 0, 2, 1])
    out = nets(d, atype)
    for i, t in enumerate(atype.tolist()):
        want = nets.networks[0](d[:, i]) + nets.bias_atom_e[t]
        torch.testing.assert_close(out[:, i], want * (t != 2), rtol=1e-13, atol=1e-13)
    scripted = torch.jit.script(nets)
    torch.testing.assert_close(scripted(d, atype), out, rtol=1e-13, atol=1e-13)


def test_shared_energy_net_takes_frame_and_atomic_parameters():
    fit = EnergyFitting(2, 5, [6, 6], seed=3, numb_fparam=2, numb_aparam=1, mixed_types=True)
    with torch.no_grad():
        fit.fparam_avg.copy_(torch.tensor([0.5, -1.0]))
        fit.fparam_inv_std.copy_(torch.tensor([2.0, 0.5]))
        fit.aparam_avg.fill_(0.25)
    d = torch.randn(2, 3, 5, dtype=torch.float64)
    fp = torch.randn(2, 2, dtype=torch.float64)
    ap = torch.randn(2, 3, 1, dtype=torch.float64)
    out = fit(d, torch.tensor([0, 1, 1]), fp, ap)
    fpn = ((fp - fit.fparam_avg) * fit.fparam_inv_std).unsqueeze(1).expand(2, 3, 2)
    rows = torch.cat([d, fpn, (ap - 0.25)], dim=-1)
    torch.testing.assert_close(
        out, fit.networks[0](rows.reshape(6, 8)).view(2, 3), rtol=1e-13, atol=1e-13
    )
    scripted = torch.jit.script(fit)
    torch.testing.assert_close(scripted(d, torch.tensor([0, 1, 1]), fp, ap), out)


def test_se_atten_model_with_fparam_trains_one_net():
    cfg = battery_config("se_atten")
    cfg["fitting_net"]["numb_fparam"] = 1
    model = set_random_stats(EnergyModel(cfg))
    assert len(model.fitting.networks) == 1 and model.fitting.dim_in == model.descriptor.dim_out + 1
    coord, atype = water_like(2, None, seed=2)
    from mdtrain.model.conservative import pair_vectors
    from mdtrain.neighbors.layout import layout_of

    nlist, shift, _ = layout_of(model).build(coord, None, atype, model.rcut, model.sel)
    x = torch.tensor(coord)[None]
    diff = pair_vectors(x, None, torch.tensor(nlist)[None], torch.tensor(shift)[None])
    e = model.atomic_energy(diff, torch.tensor(nlist)[None], torch.tensor(atype), torch.ones(1, 1))
    e.sum().backward()
    assert float(model.fitting.networks[0].layers[0].weight.grad.abs().sum()) > 0


def test_tensor_fitting_dict_of_one_net_both_ways():
    nets = TypeFittingNets(2, 7, 4, [5], seed=2, mixed_types=True)
    fitting = DipoleFitting(nets, 4)
    fcfg = {"type": "dipole", "neuron": [5], "resnet_dt": True}
    data = fitting_to_deepmd(fitting, fcfg, ["O", "H"], "tanh")
    assert data["mixed_types"] is True and data["nets"]["ndim"] == 0
    assert len(data["nets"]["networks"]) == 1
    state: dict = {}
    fitting_from_deepmd(Reader("x.dp"), data, 2, state)
    assert {k for k in state if ".networks." in k} == {
        f"fitting.nets.networks.0.layers.{i}.{p}" for i in (0, 1) for p in ("weight", "bias")
    }
    torch.testing.assert_close(
        state["fitting.nets.networks.0.layers.1.weight"], nets.networks[0].layers[1].weight
    )
    data["nets"]["networks"].append(data["nets"]["networks"][0])
    with pytest.raises(MDTrainError, match="model/fitting/nets: 2 networks, expected one for all"):
        fitting_from_deepmd(Reader("x.dp"), data, 2, {})


def _dp_dict(name: str) -> dict:
    model = set_random_stats(EnergyModel(battery_config(name))).eval()
    return {"model": model_to_deepmd(model)}, model


def test_dp_of_a_type_mixed_descriptor_reads_back_the_one_net():
    data, model = _dp_dict("se_atten")
    config, state = deepmd_to_model(data, "m.dp")
    back = EnergyModel(config)
    back.load_state_dict(state)
    coord, atype = water_like(3, None, seed=5)
    np.testing.assert_array_equal(
        evaluate(back, coord, None, atype)["force"], evaluate(model, coord, None, atype)["force"]
    )


@pytest.mark.parametrize(
    ("name", "given", "match"),
    [
        ("se_atten", False, "mixed_types: False with descriptor se_atten.*one net for all types"),
        ("se_e2_a", True, "mixed_types: True with descriptor se_e2_a.*one net per type"),
    ],
)
def test_dp_whose_fitting_is_not_its_descriptors_is_refused(name, given, match):
    data, _ = _dp_dict(name)
    data["model"]["fitting"]["mixed_types"] = given
    with pytest.raises(MDTrainError, match=f"m.dp: model/fitting/{match}") as info:
        deepmd_to_model(data, "m.dp")
    assert "\n" not in str(info.value)


def test_checkpoint_with_one_net_per_type_for_se_atten_is_refused(tmp_path):
    """The layout mdtrain wrote before its fitting followed DeePMD-kit's: refused in one line
    (loading only net 0 would silently change the model)."""
    model = set_random_stats(EnergyModel(battery_config("se_atten"))).eval()
    path = save_tiny_checkpoint(tmp_path / "old.pt", model)
    state = torch.load(path, weights_only=True)
    for key in [k for k in state["model_state"] if k.startswith("fitting.networks.0.")]:
        state["model_state"][key.replace(".0.", ".1.", 1)] = state["model_state"][key].clone()
    torch.save(state, path)
    with pytest.raises(MDTrainError, match="has one fitting net per type.*retrain it") as info:
        load_checkpoint(path)
    assert str(info.value).startswith(f"checkpoint {path}: its se_atten model")
    assert "\n" not in str(info.value)
