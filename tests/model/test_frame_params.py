"""Frame and atomic parameters (numb_fparam, numb_aparam): forces and virials by finite
differences with the parameters given, their effect on the energy, default_fparam, the
statistics against a numpy formula, TorchScript, and the accelerated backends' refusal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model import EnergyModel
from mdtrain.model.backend import build_model, choose_backend
from mdtrain.model.config import normalize_model_config
from mdtrain.model.stats.params import avg_std, set_param_stats
from mdtrain.neighbors.nlist import build_nlist
from tests.helpers.models import set_random_stats, small_config, strained, water_like

PARAMS = {"numb_fparam": 2, "numb_aparam": 1}


def _model(**fitting) -> EnergyModel:
    model = set_random_stats(EnergyModel(small_config(fitting={**PARAMS, **fitting})))
    with torch.no_grad():
        model.fitting.fparam_avg.copy_(torch.tensor([0.3, -0.2], dtype=torch.float64))
        model.fitting.fparam_inv_std.copy_(torch.tensor([2.0, 0.5], dtype=torch.float64))
        model.fitting.aparam_avg.fill_(0.1)
        model.fitting.aparam_inv_std.fill_(3.0)
    return model


def _run(model, coord, box, atype, fparam, aparam):
    nlist, shift, _ = build_nlist(coord, box, atype, float(model.rcut), list(model.sel))
    out = model(
        torch.tensor(coord)[None],
        torch.tensor(atype),
        None if box is None else torch.tensor(box)[None],
        torch.tensor(nlist)[None],
        torch.tensor(shift)[None],
        None if fparam is None else torch.tensor(fparam)[None],
        None if aparam is None else torch.tensor(aparam)[None],
    )
    return {k: v.detach()[0].numpy() for k, v in out.items()}


@pytest.fixture
def frame():
    box = np.diag([6.0, 6.2, 5.8])
    coord, atype = water_like(3, box, seed=4)
    rng = np.random.default_rng(1)
    return coord, box, atype, rng.normal(size=2), rng.normal(size=(len(atype), 1))


def test_forces_and_virial_by_finite_differences(frame) -> None:
    coord, box, atype, fp, ap = frame
    model = _model()
    out = _run(model, coord, box, atype, fp, ap)
    h = 1e-5
    for atom, k in ((0, 0), (4, 2), (7, 1)):
        plus, minus = coord.copy(), coord.copy()
        plus[atom, k] += h
        minus[atom, k] -= h
        e_p = _run(model, plus, box, atype, fp, ap)["energy"]
        e_m = _run(model, minus, box, atype, fp, ap)["energy"]
        assert out["force"][atom, k] == pytest.approx(-(e_p - e_m) / (2 * h), abs=1e-7)
    for j, k in ((0, 0), (1, 2), (2, 1)):
        eps = np.zeros((3, 3))
        eps[j, k] = h
        e_p = _run(model, *strained(coord, box, eps), atype, fp, ap)["energy"]
        e_m = _run(model, *strained(coord, box, -eps), atype, fp, ap)["energy"]
        assert out["virial"][j, k] == pytest.approx(-(e_p - e_m) / (2 * h), abs=1e-6)


def test_parameters_change_the_energy_as_a_shifted_input(frame) -> None:
    """The fitting sees (x - avg) * inv_std: moving avg with x leaves the energy unchanged."""
    coord, box, atype, fp, ap = frame
    model = _model()
    e0 = _run(model, coord, box, atype, fp, ap)["energy"]
    e1 = _run(model, coord, box, atype, fp + 0.5, ap)["energy"]
    assert abs(e1 - e0) > 1e-6
    with torch.no_grad():
        model.fitting.fparam_avg.add_(0.5)
    assert _run(model, coord, box, atype, fp + 0.5, ap)["energy"] == pytest.approx(e0, abs=1e-12)
    e2 = _run(model, coord, box, atype, fp + 0.5, ap * 2)["energy"]
    assert abs(e2 - e0) > 1e-6


def test_default_fparam_and_missing_parameters(frame) -> None:
    coord, box, atype, fp, ap = frame
    model = _model(default_fparam=[float(v) for v in fp])
    given = _run(model, coord, box, atype, fp, ap)["energy"]
    assert _run(model, coord, box, atype, None, ap)["energy"] == given
    with pytest.raises(Exception, match="aparam"):
        _run(model, coord, box, atype, fp, None)
    with pytest.raises(Exception, match="fparam"):
        _run(_model(), coord, box, atype, None, ap)


def test_torchscript_gives_the_same(frame) -> None:
    coord, box, atype, fp, ap = frame
    model = _model()
    scripted = torch.jit.script(model)
    a = _run(model, coord, box, atype, fp, ap)
    b = _run(scripted, coord, box, atype, fp, ap)
    np.testing.assert_allclose(b["force"], a["force"], rtol=0, atol=1e-12)


def test_config_checks() -> None:
    with pytest.raises(MDTrainError, match="default_fparam: 1 values but numb_fparam is 2"):
        normalize_model_config(small_config(fitting={"numb_fparam": 2, "default_fparam": [1]}))
    with pytest.raises(MDTrainError, match="numb_aparam"):
        normalize_model_config(small_config(fitting={"numb_aparam": -1}))


def test_accelerated_backends_refuse_and_auto_chooses_reference() -> None:
    cfg = normalize_model_config(small_config(fitting=PARAMS))
    name, why = choose_backend(cfg, torch.device("cpu"))
    assert name == "reference" and "numb_fparam" in why
    with pytest.raises(MDTrainError, match="frame/atomic parameters"):
        choose_backend(cfg, torch.device("cpu"), forced="fused")
    assert type(build_model(small_config(fitting=PARAMS))) is EnergyModel


class _Sys:
    def __init__(self, fparam, aparam):
        self.data = {"fparam": fparam, "aparam": aparam}
        self.nframes = len(fparam)

    def has(self, name):
        return self.data[name] is not None

    def frames(self, rows, labels, positions):
        return {k: self.data[k][rows] for k in labels}


def test_statistics_match_numpy() -> None:
    rng = np.random.default_rng(3)
    systems = [
        _Sys(rng.normal(2.0, 0.5, size=(7, 2)), rng.normal(-1, 3, size=(7, 5, 1))),
        _Sys(np.tile([1.0, 4.0], (5, 1)), rng.normal(size=(5, 3, 1))),
    ]
    # a constant second fparam column in system 2 and varied in system 1
    plan = [(0, 0, 3), (0, 3, 6), (1, 0, 4)]
    model = _model()
    set_param_stats(model, systems, plan, protect=1e-2)
    fp = np.concatenate([systems[0].data["fparam"][:6], systems[1].data["fparam"][:4]])
    ap = np.concatenate(
        [systems[0].data["aparam"][:6].reshape(-1), systems[1].data["aparam"][:4].reshape(-1)]
    )
    np.testing.assert_allclose(model.fitting.fparam_avg.numpy(), fp.mean(0), rtol=1e-12)
    np.testing.assert_allclose(model.fitting.fparam_inv_std.numpy(), 1 / fp.std(0), rtol=1e-9)
    np.testing.assert_allclose(model.fitting.aparam_avg.numpy(), [ap.mean()], rtol=1e-12)
    np.testing.assert_allclose(model.fitting.aparam_inv_std.numpy(), [1 / ap.std()], rtol=1e-9)


def test_statistics_protection() -> None:
    sums = np.array([4.0, 8.0, 2.0, 16.0, 1.0 + 1e-9])  # column 0 constant 2, column 1 ~ 0.5
    mean, std = avg_std(sums, 2, protect=0.05)
    np.testing.assert_allclose(mean, [2.0, 0.5])
    assert std[0] == 0.05  # a constant column: the protection
    assert std[1] == 0.05  # variance ~0 as well
    assert avg_std(np.zeros(3), 1, 0.01)[1][0] == 0.1


def test_dp_round_trip_keeps_parameters_and_statistics(tmp_path, frame) -> None:
    from mdtrain.model.deepmd_file import load_dp, read_dp, write_dp

    coord, box, atype, fp, ap = frame
    model = _model(default_fparam=[0.5, 1.5])
    path = tmp_path / "model.dp"
    write_dp(model, path)
    fitting = read_dp(path)["model"]["fitting"]
    assert (fitting["numb_fparam"], fitting["numb_aparam"]) == (2, 1)
    assert fitting["default_fparam"] == [0.5, 1.5]
    np.testing.assert_array_equal(fitting["@variables"]["fparam_inv_std"], [2.0, 0.5])
    assert fitting["dim_descrpt"] == model.descriptor.dim_out
    loaded = load_dp(path)
    back = EnergyModel(loaded["model_config"])
    back.load_state_dict(loaded["model_state"])
    a = _run(model, coord, box, atype, fp, ap)
    b = _run(back, coord, box, atype, fp, ap)
    assert b["energy"] == pytest.approx(float(a["energy"]), abs=1e-12)
    np.testing.assert_allclose(b["force"], a["force"], rtol=0, atol=1e-12)
    assert _run(back, coord, box, atype, None, ap)["energy"] == pytest.approx(
        float(_run(model, coord, box, atype, None, ap)["energy"]), abs=1e-12
    )
