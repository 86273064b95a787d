"""``mdtrain freeze``: the TorchScript file gives the checkpoint's outputs, in this process
and in a fresh one that never imports mdtrain; metadata; calculator and ``mdtrain test``
accept it; error paths."""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import is_torchscript, load_model, read_frozen_metadata
from mdtrain.model import EnergyModel
from tests.helpers.datagen import random_water_like, water_labeled, write_npy_system
from tests.helpers.models import save_tiny_checkpoint, tiny_model, water_batch
from tests.helpers.processes import python_without_mdtrain

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*deprecated:DeprecationWarning")


def batch_inputs(periodic: bool) -> tuple:
    """Two frames of 24 atoms (sorted O first), with neighbour lists, as model inputs."""
    return water_batch(4.0, [16, 32], 2, 8, 6.4, periodic, 5)


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> tuple[str, str]:
    """(checkpoint, frozen file) of the same tiny model."""
    tmp = tmp_path_factory.mktemp("freeze")
    ckpt = save_tiny_checkpoint(tmp / "model.ckpt.pt")
    out = tmp / "frozen.pth"
    assert main(["freeze", ckpt, "-o", str(out)]) == 0
    return ckpt, str(out)


def assert_same(out: dict, ref: dict, tol: float = 1e-10) -> None:
    for key in ("energy", "atom_energy", "force", "virial"):
        torch.testing.assert_close(out[key].detach(), ref[key].detach(), rtol=0, atol=tol)


@pytest.mark.parametrize("periodic", [True, False])
def test_frozen_matches_checkpoint(frozen, periodic):
    ckpt, path = frozen
    args = batch_inputs(periodic)
    ref = load_model(ckpt)(*args)
    assert ref["force"].abs().max() > 1e-3  # not a trivially flat model
    loaded = torch.jit.load(path)
    with torch.enable_grad():
        assert_same(loaded(*args), ref)
    scripted = load_model(path, scripted=True)
    assert isinstance(scripted, torch.jit.ScriptModule) and not scripted.training
    with torch.enable_grad():
        assert_same(scripted(*args), ref)
    # by default the weights go into the eager model (fused nodes, compiled kernels)
    eager = load_model(path)
    assert isinstance(eager, EnergyModel) and not eager.training
    assert list(eager.type_map) == list(scripted.type_map) and eager.sel == scripted.sel
    assert_same(eager(*args), ref)


def test_frozen_with_mismatched_metadata_is_one_line_error(frozen, tmp_path):
    _, path = frozen
    metadata = read_frozen_metadata(path)
    metadata["model_config"]["descriptor"]["neuron"] = [3, 6, 12]
    odd = tmp_path / "odd.pth"
    torch.jit.save(torch.jit.load(path), odd, _extra_files={"mdtrain.json": json.dumps(metadata)})
    with pytest.raises(MDTrainError, match=r"odd\.pth: frozen weights do not match model_config"):
        load_model(odd)
    assert isinstance(load_model(odd, scripted=True), torch.jit.ScriptModule)


def test_frozen_without_metadata_loads_scripted(frozen, tmp_path):
    """A TorchScript file without mdtrain's metadata (saved by other means) runs as it is."""
    _, path = frozen
    bare = tmp_path / "bare.pth"
    torch.jit.save(torch.jit.load(path), bare)
    model = load_model(bare)
    assert isinstance(model, torch.jit.ScriptModule)


def test_frozen_attributes_and_metadata(frozen):
    ckpt, path = frozen
    assert is_torchscript(path) and not is_torchscript(ckpt)
    model = torch.jit.load(path)
    assert model.type_map == ["O", "H"] and model.rcut == 4.0 and model.sel == [16, 32]
    meta = read_frozen_metadata(path)
    assert meta["type_map"] == ["O", "H"] and meta["rcut"] == 4.0 and meta["sel"] == [16, 32]
    assert meta["model_config"] == tiny_model().get_model_config()
    assert meta["step"] == 0 and meta["mdtrain_version"]
    extra = {"mdtrain.json": ""}
    torch.jit.load(path, _extra_files=extra)
    assert json.loads(extra["mdtrain.json"])["format"] == "mdtrain-frozen"


FRESH = r"""
import sys, torch
model = torch.jit.load(sys.argv[1])
args = torch.load(sys.argv[2])
with torch.enable_grad():
    out = model(args["coord"], args["atype"], args.get("box"), args["nlist"], args["shift"])
torch.save({k: v.detach() for k, v in out.items()}, sys.argv[3])
bad = [m for m in sys.modules if m.split(".")[0] in ("mdtrain", "vesin", "ase", "tests")]
assert not bad, bad
print(list(model.type_map), float(model.rcut), list(model.sel))
"""


@pytest.mark.multiprocess
def test_frozen_in_fresh_process_without_mdtrain(frozen, tmp_path):
    ckpt, path = frozen
    coord, atype, box, nlist, shift = batch_inputs(True)
    torch.save(
        {"coord": coord, "atype": atype, "box": box, "nlist": nlist, "shift": shift},
        tmp_path / "in.pt",
    )
    proc = python_without_mdtrain(
        FRESH, path, str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['O', 'H'] 4.0 [16, 32]"
    out = torch.load(tmp_path / "out.pt")
    assert_same(out, load_model(ckpt)(coord, atype, box, nlist, shift))


@pytest.fixture(scope="module")
def deepmd_file(frozen) -> str:
    """The same model as DeePMD-kit's model file (``freeze -o *.dp``)."""
    ckpt, _ = frozen
    path = os.path.join(os.path.dirname(ckpt), "model.dp")
    assert main(["freeze", ckpt, "-o", path]) == 0
    return path


def test_calculator_accepts_frozen_and_dp(frozen, deepmd_file):
    from ase import Atoms

    from mdtrain.infer.calculator import MDTrainCalculator

    ckpt, path = frozen
    coords, types, boxes = random_water_like(1, 8, 6.4, seed=7)
    symbols = ["O" if t == 0 else "H" for t in types]
    results = []
    for source in (ckpt, path, deepmd_file):
        atoms = Atoms(symbols, positions=coords[0], cell=boxes[0], pbc=True)
        atoms.calc = MDTrainCalculator(source)
        results.append((atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()))
    e0, f0, s0 = results[0]
    for e1, f1, s1 in results[1:]:
        assert abs(e0 - e1) < 1e-10
        np.testing.assert_allclose(f1, f0, rtol=0, atol=1e-10)
        np.testing.assert_allclose(s1, s0, rtol=0, atol=1e-12)


def test_mdtrain_test_accepts_frozen_and_dp(frozen, deepmd_file, tmp_path):
    ckpt, path = frozen
    system = write_npy_system(tmp_path / "sys", **water_labeled(nframes=3, seed=6))
    figures = []
    runs = ((ckpt, []), (path, []), (path, ["--torchscript"]), (deepmd_file, []))
    for model, options in runs:
        out = tmp_path / "res.json"
        assert main(["test", "-m", model, "-s", system, "--json", str(out), *options]) == 0
        figures.append(json.loads(out.read_text())["total"])
    for other in figures[1:]:
        assert other.keys() == figures[0].keys()
        for key, value in figures[0].items():
            assert other[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key


def test_freeze_errors(tmp_path, capsys):
    assert main(["freeze", str(tmp_path / "missing.pt"), "-o", str(tmp_path / "m.pth")]) == 1
    assert "missing.pt: file not found" in capsys.readouterr().err
    ckpt = save_tiny_checkpoint(tmp_path / "c.pt")
    assert main(["freeze", ckpt, "-o", str(tmp_path / "no" / "dir" / "m.pth")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "m.pth").exists()


def test_freeze_dp_to_torchscript(frozen, deepmd_file, tmp_path):
    """A DeePMD-kit file freezes to TorchScript like a checkpoint (the same outputs)."""
    ckpt, _ = frozen
    out = tmp_path / "from_dp.pth"
    assert main(["freeze", deepmd_file, "-o", str(out)]) == 0
    args = batch_inputs(True)
    with torch.enable_grad():
        assert_same(torch.jit.load(out)(*args), load_model(ckpt)(*args))


def test_freeze_refuses_frozen_input(frozen, tmp_path):
    _, path = frozen
    with pytest.raises(MDTrainError, match="already a frozen"):
        main(["--debug", "freeze", path, "-o", str(tmp_path / "again.pth")])


def test_truncated_frozen_file(frozen, tmp_path):
    _, path = frozen
    size = os.path.getsize(path)
    broken = tmp_path / "broken.pth"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(broken, "w") as zout:
        for item in zin.infolist():  # a TorchScript archive with its weights missing
            if "/data/" not in item.filename:
                zout.writestr(item, zin.read(item.filename))
    assert broken.stat().st_size < size and is_torchscript(broken)
    with pytest.raises(MDTrainError, match="broken.pth: cannot load the frozen model"):
        load_model(broken)


def test_freeze_takes_deepmd_style_checkpoint_option(frozen, tmp_path, capsys):
    """``-c`` with a file or a training output directory (its model.ckpt.pt), as dp freeze."""
    ckpt, _ = frozen
    directory = os.path.dirname(ckpt)  # holds model.ckpt.pt
    for i, args in enumerate((["-c", ckpt], ["-c", directory], [directory])):
        out = tmp_path / f"m{i}.pth"
        assert main(["freeze", *args, "-o", str(out)]) == 0
        assert torch.jit.load(str(out)).type_map == ["O", "H"]
    assert main(["freeze", ckpt, "-c", ckpt, "-o", str(tmp_path / "x.pth")]) == 1
    assert "give the checkpoint once" in capsys.readouterr().err
