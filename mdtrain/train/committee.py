"""What makes a run a committee: its size (``--ensemble``), the input each member is the single
run of, and how the members draw their frames.

Member ``k`` of a committee of K is exactly the single run of `member_config` (K = 1 is a
single run, member 0 its only member). Two ways of sampling:

- ``"shared"`` (fresh models): member k's model seeds are the input's + k and its training
  seed the input's, so every member draws the same frames in the same order: the trainer
  takes each step with one batch and one forward of the committee model (the accelerated one
  computes the environment matrix once for all members and batches their networks).
- ``"per-member"`` (``--init-model``/``--finetune``: every member starts from the same
  weights): member k's training seed is the input's + k, so the members draw different
  frames, and each member's batch is evaluated by that member alone.

Statistics (davg/dstd, energy bias) depend on the data only: they are computed once and
copied into every member (``mdtrain.model.committee.share_statistics``).
"""

from __future__ import annotations

import copy

from mdtrain.errors import MDTrainError
from mdtrain.model.committee import member_model_config

SHARED, PER_MEMBER = "shared", "per-member"


def ensemble_size(option: int | None, training: dict) -> int:
    """``--ensemble`` (wins) or ``training.ensemble``; 1 is a single run."""
    value = option if option is not None else training.get("ensemble", 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MDTrainError(f"training.ensemble / --ensemble must be an integer >= 1, got {value!r}")
    return int(value)


def member_config(config: dict, k: int, sampling: str) -> dict:
    """The input a single run would need to train member ``k``: model seeds + k ("shared"),
    or the training seed + k ("per-member"); ``training.ensemble`` 1."""
    if sampling not in (SHARED, PER_MEMBER):
        raise ValueError(f"unknown committee sampling {sampling!r}")
    config = copy.deepcopy(config)
    if sampling == SHARED:
        config["model"] = member_model_config(config["model"], k)
    else:
        config["training"]["seed"] = int(config["training"]["seed"]) + k
    config["training"]["ensemble"] = 1
    return config


def committee_tag(size: int, k: int, sampling: str) -> dict:
    """What member ``k``'s checkpoints record of its committee (nothing for a single run)."""
    if size == 1:
        return {}
    return {"committee": {"size": size, "member": k, "sampling": sampling}}
