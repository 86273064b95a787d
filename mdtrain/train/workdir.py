"""The output directory of a training run: every place it writes checked before any work
(`mdtrain.outputs.check_outputs`: no output over one of the run's inputs, nor over a file
of another kind), the folders made only once the checks and the committee estimate passed,
and the ones this run made removed again when it fails before writing anything in them."""

from __future__ import annotations

import contextlib
import os

from mdtrain.config import resolve_path
from mdtrain.errors import MDTrainError
from mdtrain.outputs import KIND_INPUT, KIND_LCURVE, KIND_STAT, Output, check_outputs
from mdtrain.train.checkpoint import CheckpointManager
from mdtrain.train.prepare import output_path
from mdtrain.train.resume import member_dirs


def run_inputs(
    config: dict, input_path: str, models: dict[str, str | None]
) -> list[tuple[str, str]]:
    """What a run reads: the input, its systems (files and folders), and ``models`` (option
    → path: ``--init-model``, ``--finetune``, ``--neighbor-stat-file``, ...)."""
    found = [("input", input_path)]
    training = config["training"]
    for section in ("training_data", "validation_data"):
        entries = (training.get(section) or {}).get("systems") or []
        for entry in [entries] if isinstance(entries, str) else entries:
            path = resolve_path(input_path, entry).partition("#")[0]
            found.append((f"training.{section}.systems", path))
    stat = training.get("neighbor_stat_file")
    if stat:
        found.append(("training.neighbor_stat_file", resolve_path(input_path, stat)))
    found += [(option, path) for option, path in models.items() if path]
    return found


def check_run_outputs(
    out_dir: str, config: dict, input_path: str, ensemble: int, inputs: list[tuple[str, str]],
    fresh: bool = True,
) -> None:  # fmt: skip
    """Every place training writes (checkpoints, lcurve.out, out.json, a new stat file; a
    committee's in every ``member-k/``), checked against ``inputs``; nothing is created.
    ``fresh``: no restart was asked for, so the run writes checkpoints from step 0 on."""
    training = config["training"]
    outputs = [
        Output("output directory", out_dir, directory=True),
        Output("out.json", output_path(out_dir, "out.json"), KIND_INPUT, create=True),
    ]
    for where in member_dirs(out_dir, ensemble):
        ckpt_dir = os.path.dirname(output_path(where, training["save_ckpt"])) or where
        outputs += [
            Output("output directory", where, directory=True),
            Output("training.save_ckpt directory", ckpt_dir, directory=True),
            Output("training.disp_file", output_path(where, training["disp_file"]), KIND_LCURVE, create=True),
            Output("out.json", output_path(where, "out.json"), KIND_INPUT, create=True),
        ]  # fmt: skip
    if fresh:
        _check_start_model(out_dir, training, ensemble, inputs)
    stat_file = training.get("stat_file")
    if stat_file:  # an existing one is read (and only its kind checked)
        path = resolve_path(input_path, stat_file)
        inside = os.path.abspath(path).startswith(os.path.abspath(out_dir) + os.sep)
        outputs.append(Output("training.stat_file", path, KIND_STAT, create=inside, reused=True))
    check_outputs(outputs, inputs)


def _check_start_model(
    out_dir: str, training: dict, ensemble: int, inputs: list[tuple[str, str]]
) -> None:
    """``--init-model``/``--finetune`` is not one of the checkpoints this run writes over."""
    managers = [
        CheckpointManager(w, training["save_ckpt"], 1) for w in member_dirs(out_dir, ensemble)
    ]
    for option, path in inputs:
        if option in ("--init-model", "--finetune") and any(m.owns(path) for m in managers):
            raise MDTrainError(
                f"{option} {path}: a checkpoint of the output directory {out_dir}, which this "
                "run writes its own checkpoints over; copy it elsewhere first, or give another -o"
            )


def make_output_dirs(out_dir: str, ensemble: int) -> list[str]:
    """Make the output directory (and a committee's ``member-k/``); returns the folders
    that did not exist before, parents first."""
    created: list[str] = []
    for where in member_dirs(out_dir, ensemble):
        missing, current = [], os.path.abspath(where)
        while not os.path.exists(current):
            missing.append(current)
            current = os.path.dirname(current)
        os.makedirs(where, exist_ok=True)
        created += [m for m in reversed(missing) if m not in created]
    return created


def remove_empty_dirs(created: list[str]) -> None:
    """Remove the folders of ``created`` that are still empty, deepest first (a failed run
    leaves no empty output folders; anything written in one keeps it)."""
    for path in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(path)
