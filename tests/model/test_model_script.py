"""TorchScript: the scripted model (and a saved/loaded one) gives the eager outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdtrain.neighbors.nlist import build_nlist
from tests.helpers.models import make_model, triclinic, water_like

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def inputs(periodic: bool):
    box = triclinic(5.0, seed=8) if periodic else None
    coord, atype = water_like(3, box, seed=8)
    coords = np.stack([coord, coord + 0.05 * np.random.default_rng(1).normal(size=coord.shape)])
    lists = [build_nlist(c, box, atype, 3.5, [16, 32]) for c in coords]
    return (
        torch.tensor(coords),
        torch.tensor(atype),
        None if box is None else torch.tensor(np.stack([box, box])),
        torch.tensor(np.stack([nl for nl, _, _ in lists])),
        torch.tensor(np.stack([sh for _, sh, _ in lists])),
    )


@pytest.mark.parametrize("periodic", [True, False])
@pytest.mark.parametrize(
    "descriptor",
    [{}, {"type_one_side": False, "exclude_types": [[0, 1]]}],
    ids=["one_side", "pairwise_excl"],
)
def test_scripted_model_matches_eager(tmp_path, periodic, descriptor):
    model = make_model({"sel": [16, 32], **descriptor}, atom_exclude_types=[]).eval()
    args = inputs(periodic)
    ref = model(*args)
    scripted = torch.jit.script(model)
    path = tmp_path / "frozen.pth"
    torch.jit.save(scripted, str(path))
    loaded = torch.jit.load(str(path))
    assert loaded.type_map == ["O", "H"] and loaded.sel == [16, 32] and loaded.rcut == 3.5
    for m in (scripted, loaded):
        out = m(*args)
        for key in ("energy", "atom_energy", "force", "virial"):
            torch.testing.assert_close(out[key], ref[key], rtol=1e-12, atol=1e-12)


def test_scripted_model_trains():
    """In train mode the scripted forward also builds the graph for a force loss."""
    model = make_model({"sel": [16, 32]}).train()
    scripted = torch.jit.script(model)
    args = inputs(True)
    for m in (model, scripted):
        m.zero_grad()
        (m(*args)["force"] ** 2).sum().backward()
    g_eager = model.fitting.networks[0].layers[0].weight.grad
    g_script = scripted.fitting.networks[0].layers[0].weight.grad
    assert g_eager is not None and g_eager.abs().max() > 0
    torch.testing.assert_close(g_script, g_eager, rtol=1e-10, atol=1e-12)
