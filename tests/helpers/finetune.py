"""Fine-tuning test helpers: a project's copy under another type_map, the model
``--finetune`` starts from (built as the run builds it), and what the refit must give."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from mdtrain.cli import main
from mdtrain.model.backend import build_model
from mdtrain.model.files import load_model_file
from mdtrain.train.finetune import finetune_config, load_pretrained, pin_pretrained_sel
from mdtrain.train.prepare import open_datasets
from tests.helpers.models import evaluate

SYSTEMS = ("train_a", "train_b", "valid")


def train(input_path: Path, *extra: str) -> int:
    return main(["train", str(input_path), "-o", str(input_path.parent / "out"), *extra])


def reversed_copy(src: Path, dst: Path, type_map: list[str]) -> Path:
    """The project with type indices swapped (O=1, H=0) and the input's type_map ``type_map``."""
    for name in SYSTEMS:
        shutil.copytree(src / "data" / name, dst / "data" / name)
        types = np.loadtxt(dst / "data" / name / "type.raw", dtype=int)
        np.savetxt(dst / "data" / name / "type.raw", 1 - types, fmt="%d")
        (dst / "data" / name / "type_map.raw").write_text("H\nO\n")
    for table in src.glob("*.txt"):  # pair tables the input names
        shutil.copy(table, dst / table.name)
    config = json.loads((src / "input.json").read_text())
    config["model"]["type_map"] = type_map
    nets = [config["model"], *config["model"].get("models", [])]
    descs = [n["descriptor"] for n in nets if "descriptor" in n]
    for k, section in enumerate(m for d in descs for m in d.get("list", [d])):
        section["seed"] = 11 + k  # fresh nets of new types: other seeds than the pretrained
        if isinstance(section.get("sel"), list) and len(section["sel"]) != len(type_map):
            section["sel"] = "auto"
    config["training"]["numb_steps"] = 2
    (dst / "input.json").write_text(json.dumps(config))
    return dst / "input.json"


def finetuned(inp: Path, source: Path) -> tuple[torch.nn.Module, dict, list]:
    """The model ``--finetune source`` starts training from, built as the run builds it."""
    from mdtrain.config import load_config
    from mdtrain.train.prepare import resolve_model_sel

    pre = load_model_file(source)
    config = finetune_config(load_config(str(inp)), pre, str(source))
    data = open_datasets(config, str(inp))
    config = pin_pretrained_sel(resolve_model_sel(config, str(inp), data, None, False), pre)
    model = build_model(config["model"], "cpu")
    load_pretrained(model, pre, data.train, int(config["model"]["data_stat_nbatch"]))
    return model, pre, data.train


def frames(system) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, float]]:
    data = system.frames(np.arange(system.nframes))
    atype = np.asarray(system.atype)
    return [
        (data["coord"][f], data["box"][f], atype, float(data["energy"][f]))
        for f in range(system.nframes)
    ]


def assert_same_model_refitted(model, old, systems, old_types, old_bias, atol=1e-12) -> None:
    """``model`` gives ``old``'s forces and virials on the same atoms (``old_types`` turns
    the new type indices into the old ones) and energies shifted by N·δ, δ the minimum-norm
    least-squares fit of label − prediction over all frames of ``systems`` (numpy here); its
    bias is the old one (in new order, ``old_bias``) plus δ. ``atol`` 0: bit for bit."""
    rows, residuals = [], []
    for system in systems:
        for coord, box, atype, label in frames(system):
            new_out = evaluate(model, coord, box, atype)
            old_out = evaluate(old, coord, box, old_types[atype])
            for key in ("force", "virial"):
                np.testing.assert_allclose(new_out[key], old_out[key], rtol=0, atol=atol)
            rows.append(np.bincount(atype, minlength=len(model.type_map)).astype(float))
            residuals.append(label - float(old_out["energy"]))
    delta = np.linalg.lstsq(np.array(rows), np.array(residuals), rcond=None)[0]
    np.testing.assert_allclose(model.out_bias.numpy(), old_bias + delta, rtol=1e-9, atol=1e-9)


def assert_same_runs_from_checkpoint_and_dp(pretrained: Path, tmp_path: Path) -> None:
    """``--finetune`` (2 steps, type_map reversed) from the checkpoint and from its ``.dp``
    file (`mdtrain freeze`): the two hold the same model, so the runs end alike."""
    dp = tmp_path / "pretrained.dp"
    assert main(["freeze", str(pretrained), "-o", str(dp)]) == 0
    for source in (pretrained, dp):
        run = tmp_path / source.suffix.strip(".")
        inp = reversed_copy(pretrained.parent.parent, run, ["H", "O"])
        assert train(inp, "--finetune", str(source)) == 0
    a = torch.load(tmp_path / "pt" / "out" / "model.ckpt.pt", weights_only=True)["model_state"]
    b = torch.load(tmp_path / "dp" / "out" / "model.ckpt.pt", weights_only=True)["model_state"]
    assert a.keys() == b.keys()
    for key in a:
        if not key.endswith("out_std"):  # a .dp carries no out_std (unused by energy models)
            torch.testing.assert_close(a[key], b[key], rtol=1e-10, atol=1e-12)
