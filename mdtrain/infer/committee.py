"""A committee of models for inference: model files and committee folders, loaded together.

A committee folder is what ``mdtrain train --ensemble N`` writes: ``member-0/``,
``member-1/``, ... each holding its ``model.ckpt.pt``. One path may name such a folder (its
members, in member order), a training output folder (its ``model.ckpt.pt``), or a model
file of any kind ``mdtrain.infer.load`` reads (checkpoint, frozen ``.pth``, DeePMD-kit
``.dp``). All members must share one ``type_map``, as ``dp model-devi`` requires.
"""

from __future__ import annotations

import logging
import os
import re

import torch

from mdtrain.errors import MDTrainError
from mdtrain.infer.finite import identical_pairs
from mdtrain.infer.load import CHECKPOINT, load_model

log = logging.getLogger("mdtrain.model_devi")

MEMBER = re.compile(r"^member-(\d+)$")


def committee_members(path: str | os.PathLike) -> list[str]:
    """The model files one argument names (see the module docstring)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return [path]
    members = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(path)
        if (m := MEMBER.match(name)) and os.path.isdir(os.path.join(path, name))
    )
    if members:
        files = [os.path.join(path, name, CHECKPOINT) for _, name in members]
        for file in files:
            if not os.path.isfile(file):
                raise MDTrainError(f"committee {path}: {file} not found")
        return files
    single = os.path.join(path, CHECKPOINT)
    if os.path.isfile(single):
        return [single]
    raise MDTrainError(
        f"model {path}: a folder with neither member-*/ folders nor {CHECKPOINT} in it"
    )


def expand_models(paths: list[str | os.PathLike]) -> list[str]:
    """The model files of every argument, in order."""
    return [file for path in paths for file in committee_members(path)]


def check_committee(models: list[torch.nn.Module], names: list[str]) -> None:
    """One-line errors for fewer than two models, models without forces (DOS, property,
    dipole, polar) or differing type maps (``names`` label the models in them); a warning for
    members with identical weights."""
    if len(models) < 2:
        raise MDTrainError(
            f"a committee needs at least two models, got {len(models)} ({' '.join(names)})"
        )
    for name, model in zip(names, models):
        kind = getattr(model, "kind", None)
        if getattr(model, "output", None) is not None or getattr(model, "label", None):
            raise MDTrainError(
                f"model {name}: a {kind} model has no energies or forces, and the committee's "
                "deviation is that of forces, energies and virials (DeePMD-kit's model-devi)"
            )
    type_map = list(models[0].type_map)
    for name, model in zip(names[1:], models[1:]):
        if list(model.type_map) != type_map:
            raise MDTrainError(
                f"model {name}: type_map {list(model.type_map)} differs from {names[0]}'s "
                f"{type_map} (a committee shares one type_map)"
            )
    for first, again in identical_pairs(models, names):
        log.warning(
            "%s and %s are the same model (identical weights): their deviation is zero, so "
            "the committee is smaller than it looks", first, again,
        )  # fmt: skip


def load_committee(
    paths: list[str | os.PathLike], device: str | torch.device = "cpu"
) -> tuple[list[torch.nn.Module], list[str]]:
    """The models (eval mode, on ``device``) that ``paths`` name, and their files."""
    files = expand_models(paths)
    if len(files) < 2:  # said before loading any
        raise MDTrainError(f"a committee needs at least two models, got {' '.join(files)}")
    models = [load_model(file, device) for file in files]
    check_committee(models, files)
    return models, files
