"""Combined models (DP+ZBL, linear_ener with a table) frozen to TorchScript (``.pth``) and
exported (``.pt2``): equal to the eager model to 1e-12 in float64 on frames of other sizes,
frame and atomic parameters reaching the network parts, and a pair below the table refused
(TorchScript) or made NaN (a program cannot raise on values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.infer.load import load_model
from mdtrain.neighbors.layout import layout_of
from tests.helpers.finite_diff import fd_forces, rel_err
from tests.helpers.model_files import (
    random_combined_model,
)
from tests.helpers.models import (
    save_tiny_checkpoint,
    small_config,
    triclinic,
    water_like,
)
from tests.helpers.pair_tables import write_table, zbl_table

KEYS = ("energy", "atom_energy", "force", "virial")
PARAMS = {"numb_fparam": 2, "numb_aparam": 1}


def combined(kind: str, table, params: bool = False):
    fit = PARAMS if params else {}
    if kind == "zbl":
        cfg = small_config(fitting=fit, use_srtab=str(table), sw_rmin=0.8, sw_rmax=1.2)
    else:
        near = small_config({"rcut": 2.5, "sel": [6, 12], "seed": 5}, fit)
        far = small_config({"seed": 7}, fit)
        pairtab = {"type": "pairtab", "tab_file": str(table), "rcut": 4.0, "sel": 60}
        cfg = {"type": "linear_ener", "type_map": ["O", "H"],
               "models": [near, far, pairtab], "weights": [0.5, -2.0, 0.25]}  # fmt: skip
    return random_combined_model(cfg)


def inputs(model, nmol: int, seed: int, periodic: bool = True, squeeze: float = 1.0):
    box = triclinic(5.2, seed=seed)
    coord, atype = water_like(nmol, box, seed=seed)
    coord = coord * squeeze
    box = box * squeeze if periodic else None
    nlist, shift, _ = layout_of(model).build(coord, box, atype, model.rcut, model.sel)
    rng = np.random.default_rng(seed)
    args = [torch.tensor(coord)[None], torch.tensor(atype),
            None if box is None else torch.tensor(box)[None],
            torch.tensor(nlist)[None], torch.tensor(shift)[None]]  # fmt: skip
    if model.parts[0].fitting.numb_fparam:
        args += [torch.tensor(rng.normal(size=(1, 2))),
                 torch.tensor(rng.uniform(size=(1, len(atype), 1)))]  # fmt: skip
    return tuple(args)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = tmp_path_factory.mktemp("table") / "zbl.txt"
    return write_table(path, zbl_table(["O", "H"], 0.2, 4.0, 0.02, zero_from=3.6))


@pytest.fixture(scope="module")
def frozen_model(table, tmp_path_factory):
    """``frozen_model(kind, params, suffix) -> (model, frozen)``: the model of ``combined``
    frozen by ``mdtrain freeze`` to ``suffix`` and loaded back (``load_model(...,
    scripted=True)``), once per module (an export takes tens of seconds of CPU and loading a
    program seconds; the tests below only evaluate them)."""
    made = {}

    def get(kind: str, params: bool, suffix: str):
        if (kind, params, suffix) not in made:
            model = combined(kind, table, params)
            tmp = tmp_path_factory.mktemp(f"{kind}-{params}")
            ckpt = save_tiny_checkpoint(tmp / "model.ckpt.pt", model)
            out = tmp / f"model{suffix}"
            assert main(["freeze", ckpt, "-o", str(out)]) == 0
            made[kind, params, suffix] = model, load_model(out, scripted=True)
        return made[kind, params, suffix]

    return get


@pytest.mark.parametrize("suffix", [".pth", ".pt2"])
@pytest.mark.parametrize("kind, params", [("zbl", False), ("linear", True)])
def test_frozen_combined_model_equals_the_eager_one(frozen_model, kind, params, suffix):
    model, frozen = frozen_model(kind, params, suffix)
    assert not isinstance(frozen, type(model))  # the frozen module, not a rebuilt eager one
    for nmol, seed, periodic in ((3, 1, True), (5, 2, False), (2, 3, True)):
        args = inputs(model, nmol, seed, periodic)
        want = model(*args)
        with torch.enable_grad():
            got = frozen(*args)
        assert want["force"].abs().max() > 1e-3
        for key in KEYS:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12, msg=key)


class WithParams:
    """``model`` called with fixed frame/atomic parameters (for the finite differences)."""

    def __init__(self, model, fparam, aparam) -> None:
        self.model, self.fparam, self.aparam = model, fparam, aparam
        self.rcut, self.sel, self.mixed_types = model.rcut, model.sel, model.mixed_types

    def __call__(self, *args):
        return self.model(*args, self.fparam, self.aparam)


def test_frame_and_atomic_parameters_reach_the_network_parts(table):
    model = combined("linear", table, params=True)
    args = inputs(model, 3, seed=4)
    fparam, aparam = args[5], args[6]
    out = model(*args)
    coord, atype, box = args[0][0].numpy(), args[1].numpy(), args[2][0].numpy()
    expected = model.out_bias[args[1]].clone()
    for weight, part in zip(model.weights.tolist(), model.parts):
        nl, sh, _ = layout_of(part).build(coord, box, atype, part.rcut, [part.nsel] * 2
                                          if not hasattr(part, "descriptor") else part.sel)  # fmt: skip
        own = (torch.tensor(nl)[None], torch.tensor(sh)[None])
        if hasattr(part, "descriptor"):  # the part alone on its own list, same parameters
            alone = part(*args[:3], *own, fparam, aparam)["atom_energy"][0]
        else:
            diff = model.pair_vectors(args[0], args[2], *own)
            alone = part.atomic_energy(diff, own[0], args[1])[0]
        expected = expected + weight * alone
    torch.testing.assert_close(out["atom_energy"][0], expected, rtol=0, atol=1e-12)
    for changed in (model(*args[:5], fparam + 1.0, aparam), model(*args[:5], fparam, 2 * aparam)):
        assert float((changed["energy"] - out["energy"]).abs()) > 1e-6  # both are used
    wrapped = WithParams(model, fparam, aparam)
    assert rel_err(out["force"][0].numpy(), fd_forces(wrapped, coord, box, atype)) < 1e-6


def test_a_pair_below_the_table_raises_in_torchscript_and_is_nan_in_a_program(frozen_model):
    model, scripted = frozen_model("zbl", False, ".pth")
    _, program = frozen_model("zbl", False, ".pt2")  # the files of the test above
    squeezed = inputs(model, 3, seed=1, squeeze=0.12)  # pairs closer than 0.2 Å
    below = pytest.raises(torch.jit.Error, match="closer than the table's first distance")
    with below, torch.enable_grad():
        scripted(*squeezed)
    got = program(*squeezed)
    assert torch.isnan(got["energy"]).all()
