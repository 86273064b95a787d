"""What a training continues from (``--restart``, "auto", a torchrun relaunch), for a single
run and for a committee, and the refusals that keep a restart from starting over on top of
work already on disk.

"auto" starts fresh only where there is nothing to lose: no checkpoint at all. Where
checkpoints exist but none can be continued (every one damaged; a committee member missing,
damaged without an earlier step every member has, or a committee of another size on disk)
it stops with one line naming the member or file and what to do, instead of writing new
checkpoints and ``lcurve.out`` over the old ones.
"""

from __future__ import annotations

import logging
import os
import re

from mdtrain import distributed as dist_rt
from mdtrain.errors import MDTrainError
from mdtrain.model.files import load_checkpoint
from mdtrain.train.checkpoint import CheckpointManager

log = logging.getLogger("mdtrain")

MEMBER_PREFIX = "member-"
_MEMBER_DIR = re.compile(re.escape(MEMBER_PREFIX) + r"(\d+)")


def member_dir(out_dir: str, k: int) -> str:
    """Where member ``k`` writes (its lcurve.out, checkpoints and out.json)."""
    return os.path.join(out_dir, f"{MEMBER_PREFIX}{k}")


def member_dirs(out_dir: str, size: int) -> list[str]:
    """Where each model of a run of ``size`` writes: a single run in ``out_dir`` itself, a
    committee's members in ``member-k/``."""
    return [out_dir] if size == 1 else [member_dir(out_dir, k) for k in range(size)]


def members_on_disk(out_dir: str) -> list[int]:
    """The indices of the ``member-k/`` folders in ``out_dir`` (a committee's), sorted."""
    try:
        names = os.listdir(out_dir)
    except OSError:
        return []
    found = (_MEMBER_DIR.fullmatch(n) for n in names)
    return sorted(
        int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(out_dir, m.group(0)))
    )


def restart_request(asked: str | None) -> tuple[str | None, bool]:
    """What to continue from, and whether it comes from a torchrun relaunch.

    When torchrun relaunches the group after a failure (``TORCHELASTIC_RESTART_COUNT`` > 0)
    the run continues from its own newest checkpoint: "auto", falling back to what was asked
    for when there is none yet.
    """
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    if count.isdigit() and int(count) > 0:
        log.info("relaunched by torchrun (restart %s): continuing with --restart auto", count)
        return "auto", True
    return asked, False


def resolve_restart(
    asked: str | None, start_model: str | None, option: str, training: dict, out_dir: str,
    ensemble: int = 1,
) -> tuple[str | None, str | None]:  # fmt: skip
    """``(restart, start model)`` after "auto" (module docstring). ``asked``: ``--restart``
    or ``training.restart``; ``start_model``: the ``--init-model``/``--finetune`` model
    (``option`` names which). "auto" and a start model combine: resume when the output
    directory has a checkpoint, else start from the model; a job script can pass both on
    every submission. A committee restarts from member 0's checkpoint of the newest step
    every member has."""
    restart, relaunched = restart_request(asked)
    if restart != "auto":
        if restart and start_model:
            raise MDTrainError(f"--restart and {option} exclude each other")
        return restart, start_model
    if ensemble == 1:
        found = dist_rt.run_on_main(single_restart_point, out_dir, training)
    else:
        found = dist_rt.run_on_main(committee_restart_point, out_dir, training, ensemble)
    if found:
        log.info("restart auto: continuing from %s", found)
        if start_model:
            log.info("restart auto: %s %s is not used", option, start_model)
        return found, None
    if relaunched and asked not in (None, "auto"):
        log.info("restart auto: no checkpoint yet, using %s", asked)
        return asked, None
    log.info("restart auto: no checkpoint found, starting %s",
             f"from {start_model}" if start_model else "fresh")  # fmt: skip
    return None, start_model


def _manager(where: str, training: dict) -> CheckpointManager:
    return CheckpointManager(where, training["save_ckpt"], int(training["max_ckpt_keep"]))


def single_restart_point(out_dir: str, training: dict) -> str | None:
    """The newest checkpoint of ``out_dir`` that loads; None when it has none at all."""
    manager = _manager(out_dir, training)
    found = manager.latest()
    ckpts = manager.checkpoints()
    if found is None and ckpts:
        newest = ckpts[-1][1]
        raise MDTrainError(
            f"--restart auto: no checkpoint in {out_dir} loads (the newest, {newest}, and "
            f"{len(ckpts) - 1} older are damaged); restore one, or give another -o to start "
            "over (nothing was overwritten)"
        )
    return found


def committee_restart_point(out_dir: str, training: dict, size: int) -> str | None:
    """Member 0's checkpoint of the newest step that every member has intact (a committee
    killed while saving may have some members one save ahead); None when no member has any
    checkpoint. A missing or damaged member, or a committee of another size, is an error."""
    on_disk = members_on_disk(out_dir)
    if not on_disk:
        return None
    managers = [
        _manager(member_dir(out_dir, k), training) for k in range(max(size, on_disk[-1] + 1))
    ]
    steps = [{s for s, _ in m.checkpoints()} for m in managers]
    if not any(steps):
        return None
    n = _size_on_disk(managers, on_disk)
    if n != size:
        raise MDTrainError(
            f"--restart auto: {out_dir} holds a committee of {n} (member-0 ... member-{n - 1}), "
            f"not {size}: continue it with --ensemble {n}, or give another -o for a committee "
            f"of {size} (nothing was overwritten)"
        )
    for k in range(size):
        if not steps[k]:
            where = member_dir(out_dir, k)
            what = "has no checkpoint" if os.path.isdir(where) else "is missing"
            raise MDTrainError(
                f"--restart auto: committee {out_dir}: member {k} ({where}) {what}; restore it, "
                f"or give another -o to start a new committee (nothing was overwritten)"
            )
    return _newest_intact(out_dir, managers[:size], steps[:size])


def _size_on_disk(managers: list[CheckpointManager], on_disk: list[int]) -> int:
    """The committee size its checkpoints record (the newest that loads), else the number
    of member folders."""
    for manager in managers:
        for _, path in reversed(manager.checkpoints()):
            try:
                saved = load_checkpoint(path).get("committee")
            except MDTrainError:
                continue
            if saved and "size" in saved:
                return int(saved["size"])
    return on_disk[-1] + 1


def _newest_intact(out_dir: str, managers: list[CheckpointManager], steps: list[set]) -> str:
    """Member 0's checkpoint of the newest step every member loads (see the caller)."""
    first_damage: tuple[int, str] | None = None
    for step in sorted(set.intersection(*steps), reverse=True):
        paths = [m.path_for(step) for m in managers]
        bad = None
        for k, path in enumerate(paths):
            try:
                load_checkpoint(path)
            except MDTrainError as exc:
                bad = (k, str(exc))
                break
        if bad is None:
            return paths[0]
        first_damage = first_damage or bad
        log.warning("skipping the committee checkpoints of step %d: %s", step, bad[1])
    if first_damage is None:
        k = min(range(len(steps)), key=lambda j: max(steps[j]))
        raise MDTrainError(
            f"--restart auto: committee {out_dir}: member {k} has no checkpoint of a step every "
            f"member has (its steps: {sorted(steps[k])}); restore its checkpoints, or give "
            "another -o to start a new committee (nothing was overwritten)"
        )
    k, reason = first_damage
    raise MDTrainError(
        f"--restart auto: committee {out_dir}: member {k} is damaged without an earlier step "
        f"every member has intact ({reason}); restore it, or give another -o to start a new "
        "committee (nothing was overwritten)"
    )


def member_checkpoints(path: str, size: int) -> list[str]:
    """Every member's checkpoint of the same step as ``path``, a checkpoint inside some
    ``member-k/`` folder of a committee's output directory (member 0's first); a single
    run's is ``path`` itself."""
    if size == 1:
        return [path]
    parts = os.path.normpath(path).split(os.sep)
    at = next((i for i in range(len(parts) - 2, -1, -1) if _MEMBER_DIR.fullmatch(parts[i])), None)
    if at is None:
        raise MDTrainError(
            f"--restart {path}: with an ensemble, give a member's checkpoint "
            f"({MEMBER_PREFIX}K/<name>.pt) or auto"
        )
    paths = []
    for k in range(size):
        parts[at] = f"{MEMBER_PREFIX}{k}"
        member = os.sep.join(parts)
        if not os.path.isfile(member):
            raise MDTrainError(f"--restart {path}: member {k} has no checkpoint {member}")
        paths.append(member)
    return paths


def check_layout(out_dir: str, training: dict, ensemble: int) -> None:
    """A single run is not pointed at a committee's folder, nor a committee at a single
    run's (either would write its files beside, or over, the other's)."""
    on_disk = members_on_disk(out_dir)
    if ensemble == 1 and on_disk:
        n = on_disk[-1] + 1
        raise MDTrainError(
            f"output directory {out_dir}: holds a committee (member-0 ... member-{n - 1}); "
            f"train it with --ensemble {n}, or give another -o for a single run"
        )
    if ensemble > 1 and _manager(out_dir, training).checkpoints():
        raise MDTrainError(
            f"output directory {out_dir}: holds a single run's checkpoints; give another -o "
            f"for a committee of {ensemble}"
        )
