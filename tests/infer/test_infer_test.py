"""``mdtrain test`` and model loading: figures equal a direct numpy computation, JSON keys,
parity plot, error paths."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import is_torchscript, load_model
from mdtrain.neighbors.nlist import build_nlist
from tests.helpers.datagen import lj_labels, random_water_like, water_labeled, write_npy_system
from tests.helpers.models import save_tiny_checkpoint, tiny_model


def predict_frame(model, coord, atype, box, rcut=4.0, sel=(16, 32)) -> dict[str, np.ndarray]:
    """One frame through the model directly (no batching, no chunking)."""
    nlist, shift, _ = build_nlist(coord, box, atype, rcut, list(sel))
    with torch.enable_grad():
        out = model(
            torch.tensor(coord)[None],
            torch.tensor(atype),
            None if box is None else torch.tensor(box)[None],
            torch.tensor(nlist)[None],
            torch.tensor(shift)[None],
        )
    return {k: v.detach()[0].numpy() for k, v in out.items()}


@pytest.fixture
def checkpoint(tmp_path) -> str:
    return save_tiny_checkpoint(tmp_path / "model.ckpt.pt")


@pytest.fixture
def three_systems(tmp_path) -> tuple[list[str], list[dict]]:
    """24-atom and 18-atom periodic systems with virials, and a 12-atom cluster without."""
    datas = [
        water_labeled(nframes=6, nmol=8, seed=0),
        water_labeled(nframes=5, nmol=6, box_len=6.0, seed=3, triclinic=True),
    ]
    coords, types, _ = random_water_like(3, 4, 6.0, seed=2)
    energy, force, _ = lj_labels(coords, types, None, rcut=4.0)
    datas.append(
        {"coords": coords, "types": types, "type_map": ["O", "H"], "boxes": None,
         "energy": energy, "force": force}
    )  # fmt: skip
    paths = [
        write_npy_system(tmp_path / name, set_size=4, **d)
        for name, d in zip(["a", "b", "cluster"], datas)
    ]
    return paths, datas


def reference_errors(model, datas: list[dict], ntest: int) -> tuple[list[dict], dict]:
    """Per-system and pooled RMSE/MAE from per-frame predictions and plain numpy."""
    per_system, pooled = [], {}
    for d in datas:
        order = np.argsort(d["types"], kind="stable")
        n = min(ntest, len(d["coords"])) if ntest else len(d["coords"])
        atype = d["types"][order]
        preds = [
            predict_frame(
                model, d["coords"][f][order], atype, None if d["boxes"] is None else d["boxes"][f]
            )
            for f in range(n)
        ]
        natoms = len(atype)
        err = {
            "energy": np.array([p["energy"] for p in preds]) - d["energy"][:n],
            "force": np.stack([p["force"] for p in preds]) - d["force"][:n][:, order],
        }
        err["energy_per_atom"] = err["energy"] / natoms
        if d.get("virial") is not None:
            err["virial"] = np.stack([p["virial"] for p in preds]) - d["virial"][:n]
            err["virial_per_atom"] = err["virial"] / natoms
        figures = {"nframes": n}
        for k, e in err.items():
            figures[_key(k, "rmse")] = float(np.sqrt(np.mean(e**2)))
            figures[_key(k, "mae")] = float(np.mean(np.abs(e)))
            pooled.setdefault(k, []).append(e.ravel())
        per_system.append(figures)
    total = {"nframes": sum(s["nframes"] for s in per_system)}
    for k, parts in pooled.items():
        e = np.concatenate(parts)
        total[_key(k, "rmse")] = float(np.sqrt(np.mean(e**2)))
        total[_key(k, "mae")] = float(np.mean(np.abs(e)))
    return per_system, total


def _key(quantity: str, stat: str) -> str:
    per_atom = quantity.endswith("_per_atom")
    return f"{quantity.removesuffix('_per_atom')}_{stat}" + ("_per_atom" if per_atom else "")


@pytest.mark.parametrize("ntest", [0, 4])
def test_figures_match_numpy(tmp_path, checkpoint, three_systems, monkeypatch, capsys, ntest):
    monkeypatch.setenv("MDTRAIN_INFER_BATCH_SIZE", "40")  # chunks of 1-3 frames
    paths, datas = three_systems
    out = tmp_path / "res.json"
    rc = main(["test", "-m", checkpoint, "-s", *paths, "-n", str(ntest), "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    want_sys, want_total = reference_errors(tiny_model(), datas, ntest)
    assert list(got["systems"]) == paths
    for path, want in zip(paths, want_sys):
        have = got["systems"][path]
        assert set(want) <= set(have)
        for key, value in want.items():
            assert have[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (path, key)
    for key, value in want_total.items():
        assert got["total"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # pooled, not an average of per-system figures
    avg = np.mean([s["force_rmse"] for s in want_sys])
    assert abs(got["total"]["force_rmse"] - avg) > 1e-6
    printed = capsys.readouterr().out
    for path in paths:
        assert f"System {path}" in printed
    assert "Total over 3 system(s)" in printed and "force" in printed


def test_json_keys_and_parity(tmp_path, checkpoint, three_systems):
    paths, _ = three_systems
    out, png = tmp_path / "res.json", tmp_path / "parity.png"
    rc = main(
        ["test", "-m", checkpoint, "-s", str(tmp_path), "--json", str(out), "--parity", str(png)]
    )
    assert rc == 0
    got = json.loads(out.read_text())
    assert sorted(got["systems"]) == sorted(paths)  # a directory expands to its systems
    basic = {"nframes", "energy_rmse", "energy_mae", "energy_rmse_per_atom", "energy_mae_per_atom",
             "force_rmse", "force_mae"}  # fmt: skip
    virial = {"virial_rmse_per_atom", "virial_mae_per_atom"}
    for path in paths:
        keys = set(got["systems"][path])
        assert basic <= keys
        assert (virial <= keys) == (not path.endswith("cluster"))
    assert basic | virial <= set(got["total"])
    assert got["total"]["nframes"] == 6 + 5 + 3
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[1] > 3 * image.shape[0] // 2


def test_load_model_checkpoint(checkpoint):
    model = load_model(checkpoint)
    assert not model.training and model.type_map == ["O", "H"] and model.sel == [16, 32]
    assert not is_torchscript(checkpoint)
    ref = tiny_model()
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)


def test_error_missing_and_corrupt_model(tmp_path, three_systems, capsys):
    paths, _ = three_systems
    assert main(["test", "-m", str(tmp_path / "nope.pt"), "-s", paths[0]]) == 1
    assert "nope.pt: file not found" in capsys.readouterr().err
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a model at all" * 10)
    with pytest.raises(MDTrainError, match="junk.pt"):
        load_model(junk)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, str(other))
    with pytest.raises(MDTrainError, match="not an mdtrain checkpoint"):
        load_model(other)


def test_error_incompatible_checkpoint(tmp_path):
    model = tiny_model()
    state = {"format": "mdtrain-checkpoint", "version": 1, "step": 0,
             "model_config": {**model.get_model_config(), "type_map": ["O", "H", "C"]},
             "model_state": model.state_dict()}  # fmt: skip
    state["model_config"]["descriptor"]["sel"] = [16, 32, 4]
    torch.save(state, str(tmp_path / "bad.pt"))
    with pytest.raises(MDTrainError, match="bad.pt: model_state does not match model_config"):
        load_model(tmp_path / "bad.pt")
    state["model_config"]["descriptor"]["sel"] = "auto"
    torch.save(state, str(tmp_path / "bad2.pt"))
    with pytest.raises(MDTrainError, match="bad2.pt: incompatible model_config.*sel"):
        load_model(tmp_path / "bad2.pt")


def test_error_element_not_in_type_map(tmp_path, checkpoint, capsys):
    d = water_labeled(nframes=2, nmol=8, seed=4)
    path = write_npy_system(tmp_path / "nacl", **{**d, "type_map": ["O", "Na"]})
    assert main(["test", "-m", checkpoint, "-s", path]) == 1
    err = capsys.readouterr().err
    assert "element Na is not in type_map ['O', 'H']" in err and "nacl" in err


def test_error_negative_numb_test(checkpoint, three_systems):
    paths, _ = three_systems
    with pytest.raises(MDTrainError, match="numb-test"):
        main(["--debug", "test", "-m", checkpoint, "-s", paths[0], "-n", "-1"])
