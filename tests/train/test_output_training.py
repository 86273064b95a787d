"""DOS and property models end to end on data the project makes itself: ``mdtrain check``,
``mdtrain train`` (the validation error falls), ``mdtrain freeze -o model.dp`` (reads back to
the checkpoint's numbers) and ``mdtrain test`` (its JSON figures are the errors recomputed
here from the model's own outputs); and the one-line errors of bad label files."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from mdtrain.cli import main
from mdtrain.config import load_config
from mdtrain.data import open_system
from mdtrain.data.labels import output_labels
from mdtrain.distributed import Runtime
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from mdtrain.model.backend import build_model
from mdtrain.model.stats import compute_or_load_stats
from mdtrain.train import loop
from mdtrain.train.loop import Trainer, seed_everything
from mdtrain.train.prepare import open_datasets
from tests.helpers.models import evaluate
from tests.helpers.output_data import make_output_project
from tests.helpers.training import lcurve_rows


@pytest.mark.parametrize("kind", ["dos", "property"])
def test_train_freeze_and_test(tmp_path, monkeypatch, kind):
    inp = make_output_project(tmp_path, kind, numb_steps=40)
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(inp)]) == 0
    out = tmp_path / "out"
    assert main(["train", str(inp), "-o", str(out)]) == 0
    rows = lcurve_rows(out / "lcurve.out")
    assert rows[-1, 1] < rows[0, 1]  # the validation loss falls
    assert main(["freeze", "-c", str(out / "model.ckpt.pt"), "-o", str(tmp_path / "m.dp")]) == 0
    frozen, trained = load_model(tmp_path / "m.dp"), load_model(out / "model.ckpt.pt")
    name = frozen.output
    system = open_system(
        str(tmp_path / "data" / "valid"), ["O", "H"], output_labels(frozen.get_model_config())
    )
    frames = system.frames(range(system.nframes))
    ours = [evaluate(frozen, c, b, system.atype) for c, b in zip(frames["coord"], frames["box"])]
    ref = [evaluate(trained, c, b, system.atype) for c, b in zip(frames["coord"], frames["box"])]
    atomic = np.stack([o[f"atom_{name}"] for o in ours])
    assert np.array_equal(atomic, np.stack([o[f"atom_{name}"] for o in ref]))
    assert main(["test", "-m", str(tmp_path / "m.dp"), "-s", "data/valid", "--json", "t.json"]) == 0
    figures = json.loads((tmp_path / "t.json").read_text())["total"]
    total = np.stack([o[name] for o in ours])
    key = "dos" if kind == "dos" else "property"
    diff = total - frames[name]
    assert figures[f"{key}_rmse"] == pytest.approx(np.sqrt(np.mean(diff**2)), rel=1e-12)
    assert figures[f"{key}_mae"] == pytest.approx(np.mean(np.abs(diff)), rel=1e-12)
    adiff = atomic - frames[f"atom_{name}"]
    assert figures[f"atom_{key}_rmse"] == pytest.approx(np.sqrt(np.mean(adiff**2)), rel=1e-12)
    if kind == "dos":  # DeePMD-kit's DOS RMSE/Natoms
        want = np.sqrt(np.mean(diff**2)) / system.natoms
        assert figures["dos_rmse_per_atom"] == pytest.approx(want, rel=1e-12)


def test_bad_label_files_are_one_line(tmp_path, capfd):
    inp = make_output_project(tmp_path, "dos", numb_steps=2, numb_dos=8)
    cfg = json.loads(inp.read_text())
    dos = tmp_path / "data" / "global" / "set.000" / "dos.npy"
    np.save(dos, np.zeros((6, 9)))
    with pytest.raises(MDTrainError, match=r"global/set.000/dos.npy: shape \[6, 9\] does not "
                       r"match \[nframes, 8\] \(the model's dos: 8 per frame\)"):  # fmt: skip
        open_system(str(dos.parents[1]), ["O", "H"], output_labels(cfg["model"]))
    dos.unlink()  # no DOS label at all: check names the system
    assert main(["check", str(inp)]) == 1
    assert "data/global: neither dos.npy nor atom_dos.npy" in capfd.readouterr().out

    prop = make_output_project(tmp_path / "p", "property", numb_steps=2)
    (tmp_path / "p" / "data" / "atomic" / "set.000" / "band_prop.npy").unlink()
    assert main(["train", str(prop), "-o", str(tmp_path / "p" / "out")]) == 1
    err = capfd.readouterr().err
    assert "data/atomic: band_prop.npy is missing (the model's property_name" in err


def test_property_names_that_mean_something_else_are_refused():
    with pytest.raises(MDTrainError, match="property_name: 'energy' names a file"):
        output_labels({"fitting_net": {"type": "property", "property_name": "energy"}})
    with pytest.raises(MDTrainError, match="property_name: required"):
        output_labels({"fitting_net": {"type": "property"}})


def _first_step_gradient(root, kind: str, micro_batches: int | None, loss_func: str = ""):
    """The gradient of a Trainer's first step on a DOS/property project (update skipped),
    and the number of forwards it took."""
    inp = make_output_project(root, kind)
    config = json.loads(inp.read_text())
    config["training"]["training_data"]["batch_size"] = 4
    if loss_func:
        config["loss"]["loss_func"] = loss_func
    if micro_batches:
        config["training"]["batch_controller"] = {"micro_batches": micro_batches}
    inp.write_text(json.dumps(config))
    config = load_config(str(inp))
    config["model"]["descriptor"]["sel"] = [16, 32]
    data = open_datasets(config, str(inp))
    seed_everything(7)
    model = build_model(config["model"], "cpu")
    compute_or_load_stats(model, data.train, None, 2)
    runtime = Runtime(0, 1, 0, 1, torch.device("cpu"), "gloo")
    trainer = Trainer(config, model, data.train, data.valid, runtime, str(root / "out"))
    trainer.optimizer.step = lambda *args, **kwargs: None  # keep the gradient as it is
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    trainer.train_step(1e-3)
    return [p.grad.detach().clone() for p in trainer.params], len(forwards)


@pytest.mark.parametrize("kind", ["dos", "property"])
def test_micro_batches_give_the_whole_batch_gradient(tmp_path, kind):
    """What the out-of-memory recovery does (a batch split into micro-batches) changes no
    gradient: both losses add up over micro-batches (the property's sums unweighted)."""
    whole, calls = _first_step_gradient(tmp_path / "whole", kind, None)
    split, split_calls = _first_step_gradient(tmp_path / "split", kind, 3)
    assert calls == 1 and split_calls == 3  # 4 frames as 2 + 1 + 1
    assert any(g.abs().max() > 0 for g in whole)
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


def test_property_rmse_is_the_root_over_the_whole_batch(tmp_path, monkeypatch):
    """``rmse``: sqrt of the mean over the whole batch, however the batch is split. The
    reference is the plain loss's own autograd on the whole batch (no global sums given);
    the trainer's path (a pass without gradients for the sums, then micro-batches) must
    give its gradient, whole or split in 3."""
    whole, calls = _first_step_gradient(tmp_path / "whole", "property", None, "rmse")
    split, split_calls = _first_step_gradient(tmp_path / "split", "property", 3, "rmse")
    assert calls == 2 and split_calls == 4  # the sums' pass, then the step's forwards
    monkeypatch.setattr(loop, "step_sums", lambda *args: contextlib.nullcontext())
    plain, _ = _first_step_gradient(tmp_path / "plain", "property", None, "rmse")
    assert any(g.abs().max() > 0 for g in plain)
    for a, b, c in zip(plain, whole, split, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
        torch.testing.assert_close(c, a, rtol=0, atol=1e-12)
    monkeypatch.setattr(loop, "step_sums", lambda *args: contextlib.nullcontext())
    naive, _ = _first_step_gradient(tmp_path / "naive", "property", 3, "rmse")
    assert max(float((a - b).abs().max()) for a, b in zip(plain, naive)) > 1e-6  # the old way
