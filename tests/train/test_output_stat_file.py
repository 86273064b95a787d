"""A DOS or property model's output statistics in ``training.stat_file``: the first run writes
them (DeePMD-kit's names, ``bias_atom_<name>``, ``std_atom_<name>``, under a hash of the
output settings), a later run takes them from the file (values changed in the file become the
model's), and a change of the settings they depend on computes them again."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.infer.load import load_model
from tests.helpers.output_data import make_output_project


def _entries(path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None
        )
    return {k: v for k, v in out.items() if "_atom_" in k}


def _train(inp, out: str) -> None:
    assert main(["train", str(inp), "-o", out]) == 0


@pytest.mark.parametrize("kind", ["dos", "property"])
def test_output_statistics_are_cached(tmp_path, monkeypatch, kind):
    inp = make_output_project(tmp_path, kind, numb_steps=1)
    config = json.loads(inp.read_text())
    config["training"].update(stat_file="stat.hdf5", disp_freq=1, save_freq=1)
    config["learning_rate"].update(start_lr=1e-12, stop_lr=1e-12)  # the step keeps the biases
    inp.write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    _train(inp, "one")
    name = "dos" if kind == "dos" else "band_prop"
    entries = _entries(tmp_path / "stat.hdf5")
    (bkey,) = [k for k in entries if k.endswith(f"/bias_atom_{name}")]
    (skey,) = [k for k in entries if k.endswith(f"/std_atom_{name}")]
    first = load_model(tmp_path / "one" / "model.ckpt.pt")
    np.testing.assert_array_equal(entries[bkey], first.out_bias.numpy())
    np.testing.assert_array_equal(entries[skey], first.out_std.numpy())
    with h5py.File(tmp_path / "stat.hdf5", "r+") as f:  # the file, not the data, is used
        f[bkey][...] = entries[bkey] + 3.0
        f[skey][...] = entries[skey] * 2.0
    _train(inp, "two")
    second = load_model(tmp_path / "two" / "model.ckpt.pt")
    np.testing.assert_allclose(second.out_bias.numpy(), entries[bkey] + 3.0, atol=1e-9)
    np.testing.assert_allclose(second.out_std.numpy(), entries[skey] * 2.0, atol=1e-12)
    config["model"]["atom_exclude_types"] = [1]  # other statistics: computed, a new entry
    inp.write_text(json.dumps(config))
    _train(inp, "three")
    assert len(_entries(tmp_path / "stat.hdf5")) == 4
    third = load_model(tmp_path / "three" / "model.ckpt.pt")
    assert np.abs(third.out_bias.numpy() - (entries[bkey] + 3.0)).max() > 1.0
