"""``mdtrain test -d`` (and ``-a``) and ``--parity`` of dipole and polar models: DeePMD-kit
3.2's detail file per system (``PREFIX.out``, ``PREFIX.out.1``, ...), one row per frame, the
labels as in the system's files and the predictions of the model evaluated frame by frame
with the atoms in the files' order (independent of mdtrain's sorting by type); a system with
its atoms shuffled gives the same frame tensors and the atomic ones in its own order."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.infer.load import load_model
from tests.helpers.datagen import shuffled_copy
from tests.helpers.models import evaluate, make_model, save_tiny_checkpoint
from tests.helpers.training import make_project, make_tensor_project

LABEL = {"dipole": "dipole", "polar": "polarizability"}
HEAD = {
    "dipole": "data_x data_y data_z pred_x pred_y pred_z",
    "polar": " ".join(f"{p}_p{a}{b}" for p in ("data", "pred") for a in "xyz" for b in "xyz"),
}


def _in_file_order(model, system) -> list[dict]:
    """The model on every frame of ``system``, atoms in the files' order."""
    atype = np.loadtxt(system / "type.raw", dtype=int)
    coord = np.load(system / "set.000" / "coord.npy")
    box = np.load(system / "set.000" / "box.npy")
    return [
        evaluate(model, c.reshape(-1, 3), b.reshape(3, 3), atype)
        for c, b in zip(coord, box, strict=True)
    ]


@pytest.mark.parametrize("kind", ["dipole", "polar"])
def test_tensor_detail_files_and_parity(tmp_path, monkeypatch, kind):
    inp = make_tensor_project(tmp_path, kind, numb_steps=2)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "out"]) == 0
    assert main(["freeze", "-c", "out/model.ckpt.pt", "-o", "m.dp"]) == 0
    valid = tmp_path / "data" / "valid"
    atype = np.loadtxt(valid / "type.raw", dtype=int)
    order = np.random.default_rng(0).permutation(len(atype))
    shuffled_copy(valid, tmp_path / "data" / "shuffled", order)
    systems = ["-s", "data/valid", "data/shuffled"]
    assert main(["test", "-m", "m.dp", *systems, "-d", "frame.txt", "--parity", "p.png"]) == 0
    assert main(["test", "-m", "m.dp", *systems, "-d", "atom.txt", "-a"]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0
    label = LABEL[kind]
    width = 3 if kind == "dipole" else 9
    model = load_model(tmp_path / "m.dp")
    out = _in_file_order(model, valid)
    nf = len(out)

    frame = np.loadtxt(tmp_path / "frame.out")
    assert (tmp_path / "frame.out").read_text().splitlines()[0] == "# " + HEAD[kind]
    assert frame.shape == (nf, 2 * width)
    np.testing.assert_array_equal(frame[:, :width], np.load(valid / "set.000" / f"{label}.npy"))
    want = np.stack([o[label].reshape(-1) for o in out])
    np.testing.assert_allclose(frame[:, width:], want, rtol=0, atol=1e-10)
    shuffled = np.loadtxt(tmp_path / "frame.out.1")  # system 1: the same frame tensors
    np.testing.assert_allclose(shuffled, frame, rtol=0, atol=1e-10)

    sel = np.flatnonzero(atype == 0)  # hydrogens excluded: the oxygens, in the files' order
    atomic = np.loadtxt(tmp_path / "atom.out")
    head = (tmp_path / "atom.out").read_text().splitlines()[0].split()
    names = HEAD[kind].split()[:width]
    assert head[1:4] == [f"{names[c]}1" for c in range(3)]
    assert head[-1] == f"pred_{names[-1][5:]}{sel.size}" and len(head) == 1 + 2 * width * sel.size
    assert atomic.shape == (nf, 2 * width * sel.size)
    raw = np.load(valid / "set.000" / f"atomic_{label}.npy").reshape(nf, len(atype), width)
    np.testing.assert_array_equal(atomic[:, : width * sel.size], raw[:, sel].reshape(nf, -1))
    pred = np.stack([o[f"atom_{label}"].reshape(len(atype), width)[sel] for o in out])
    np.testing.assert_allclose(atomic[:, width * sel.size :], pred.reshape(nf, -1), atol=1e-10)
    moved = [i for i in order if atype[i] == 0]  # the oxygens in the shuffled files' order
    per_atom = atomic.reshape(nf, 2, sel.size, width)
    expected = per_atom[:, :, np.searchsorted(sel, moved)].reshape(nf, -1)
    np.testing.assert_allclose(np.loadtxt(tmp_path / "atom.out.1"), expected, atol=1e-10)


def test_a_missing_label_is_one_line_before_any_file(tmp_path, monkeypatch, capfd):
    inp = make_tensor_project(tmp_path, "dipole", numb_steps=2)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(inp), "-o", "out"]) == 0
    capfd.readouterr()
    args = ["test", "-m", "out/model.ckpt.pt", "-d", "d.txt"]
    assert main([*args, "-s", "data/valid", "data/global", "-a"]) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "system data/global: -d -a of a dipole model compares with atomic_dipole.npy, which the "
        "system does not have"
    )
    assert main([*args, "-s", "data/atomic"]) == 1
    assert (
        "system data/atomic: -d of a dipole model compares with dipole.npy"
        in capfd.readouterr().err
    )
    assert not list(tmp_path.glob("d.*"))


def test_atomic_layout_is_refused_for_other_models(tmp_path, monkeypatch, capfd):
    make_project(tmp_path)
    checkpoint = save_tiny_checkpoint(tmp_path / "model.pt", make_model())
    monkeypatch.chdir(tmp_path)
    assert main(["test", "-m", checkpoint, "-s", "data/valid", "-d", "p", "-a"]) == 1
    assert "-a/--atomic chooses the detail layout of dipole and polar" in capfd.readouterr().err
    assert not list(tmp_path.glob("p.*"))
