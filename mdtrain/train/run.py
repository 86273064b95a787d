"""A training run: set up the run (launcher, device, data, statistics, model), then train.

``mdtrain train`` (`mdtrain.commands.train`) turns its arguments into a `TrainRequest` and
calls `run_training`; everything from there on is here, free of command-line parsing.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import secrets
from dataclasses import dataclass

import torch

from mdtrain import __version__
from mdtrain import distributed as dist_rt
from mdtrain.batching import NeighborListCache
from mdtrain.config import dump_config, load_config, resolve_path
from mdtrain.config.model_kind import model_kind, network_sections
from mdtrain.errors import MDTrainError
from mdtrain.heap import keep_freed_memory
from mdtrain.model.backend import build_models
from mdtrain.model.combined_build import build_combined_model, is_combined, take_stored_tables
from mdtrain.model.committee import members_of, share_statistics
from mdtrain.model.config import inert_settings
from mdtrain.model.energy import EnergyModel
from mdtrain.model.files import load_checkpoint, load_model_file, weights_mismatch
from mdtrain.model.stat_file import read_stat_file
from mdtrain.neighbors.sel import parse_sel
from mdtrain.train.committee import PER_MEMBER, SHARED, ensemble_size, member_config
from mdtrain.train.ensemble_budget import check_ensemble
from mdtrain.train.finetune import finetune_config, load_pretrained, pin_pretrained_sel
from mdtrain.train.loop import Trainer, seed_everything
from mdtrain.train.loss import one_sided_terms
from mdtrain.train.precision import check_networks, mode_of
from mdtrain.train.prepare import (
    check_samplers,
    model_statistics,
    neighbor_limit,
    open_datasets,
    output_path,
    resolve_sel_and_min_dist,
    stat_collector,
    stat_mode,
    validate_datasets,
)
from mdtrain.train.resume import check_layout, member_checkpoints, resolve_restart
from mdtrain.train.signals import PreemptionHandler
from mdtrain.train.workdir import (
    check_run_outputs,
    make_output_dirs,
    remove_empty_dirs,
    run_inputs,
)

log = logging.getLogger("mdtrain")


FINISHED_MARKER = "finished"


@dataclass
class TrainRequest:
    """What a run was asked for: the input file and the options of ``mdtrain train``."""

    input_path: str  # input.json
    output_dir: str = "."  # where checkpoints and logs go
    restart: str | None = None  # checkpoint to continue from, or "auto"
    init_model: str | None = None  # checkpoint or .dp model whose weights the run starts from
    finetune: str | None = None  # checkpoint or .dp model to fine-tune (mdtrain.train.finetune)
    backend: str | None = None  # process-group backend ("auto", "nccl", "gloo", "mpi")
    mixed_precision: str | None = None  # overrides training.mixed_precision ("off", ...)
    neighbor_stat_file: str | None = None  # a file written by `mdtrain neighbor-stat`
    skip_neighbor_stat: bool = False  # trust the list sel given
    ensemble: int | None = None  # committee size; overrides training.ensemble


def _resolve_restart(
    request: TrainRequest, training: dict, out_dir: str, ensemble: int = 1
) -> tuple[str | None, str | None]:
    """``(restart, init_model)`` paths after "auto" (`mdtrain.train.resume`): ``--restart``
    wins over ``training.restart``."""
    if request.init_model and request.finetune:
        raise MDTrainError("--init-model and --finetune exclude each other")
    option = "--finetune" if request.finetune else "--init-model"
    return resolve_restart(
        request.restart or training.get("restart"), request.init_model or request.finetune,
        option, training, out_dir, ensemble,
    )  # fmt: skip


def _check_compatible(state: dict, model_config: dict, path: str) -> None:
    old = state["model_config"]
    for key in ("type_map",):
        if old.get(key) != model_config.get(key):
            raise MDTrainError(
                f"checkpoint {path}: {key} {old.get(key)} differs from the input's {model_config.get(key)}"
            )


def _init_model_config(config: dict, state: dict, path: str) -> dict:
    """The input's model with the checkpoint's sel when the input's is "auto", checked early
    (before any statistics) to fit the checkpoint's weights."""
    config = copy.deepcopy(config)
    _check_compatible(state, config["model"], path)
    model, stored = config["model"], state["model_config"]
    if model_kind(model) != model_kind(stored):
        raise MDTrainError(
            f"--init-model {path}: a {model_kind(stored)} model cannot start a "
            f"{model_kind(model)} model (use --finetune)"
        )
    nets = zip(network_sections(model), network_sections(stored))  # part by part
    for (_, net), (_, old_net) in nets:
        descriptor, old_desc = net["descriptor"], old_net["descriptor"]
        pairs = [(descriptor, old_desc)]
        if "list" in descriptor and "list" in old_desc:  # a hybrid: member by member
            pairs = list(zip(descriptor["list"], old_desc["list"]))
        for given, old in pairs:
            if not isinstance(parse_sel(given.get("sel", "auto")), list) and "sel" in old:
                given["sel"] = list(old["sel"])
                log.info("init-model: sel %s taken from %s", given["sel"], path)
    take_stored_tables(model, stored, f"--init-model {path}")
    built = build_combined_model(model) if is_combined(model) else EnergyModel(model)
    _load_weights(built, state, path)
    return config


def _load_weights(model: EnergyModel, state: dict, path: str) -> None:
    mismatch = weights_mismatch(model, state["model_state"])
    if mismatch:
        raise MDTrainError(f"checkpoint {path}: weights do not fit this model: {mismatch}")
    try:
        model.load_state_dict(state["model_state"])
    except (RuntimeError, KeyError) as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = lines[1] if len(lines) > 1 else (lines or [type(exc).__name__])[0]
        raise MDTrainError(
            f"checkpoint {path}: weights do not fit this model ({detail[:300]})"
        ) from None


def _apply_precision_override(request: TrainRequest, config: dict) -> str:
    """``--mixed-precision`` replaces ``training.mixed_precision`` (so that out.json and the
    checkpoints record what ran); returns how to name the setting in messages."""
    override = request.mixed_precision
    if override is None:
        return f"{request.input_path}: training.mixed_precision"
    config["training"]["mixed_precision"] = None if override == "off" else override
    return "--mixed-precision"


def _check_stat_file(path: str) -> None:
    """An existing statistics file must be readable before neighbour statistics start."""
    read_stat_file(path)


def _prepare_outputs(request: TrainRequest, config: dict, ensemble: int = 1) -> None:
    """Check every place training writes against what it reads (`mdtrain.train.workdir`),
    and that a single run and a committee do not share a folder; nothing is created."""
    training, path = config["training"], request.input_path
    models = {"--init-model": request.init_model, "--finetune": request.finetune}
    inputs = run_inputs(
        config, path, {"--neighbor-stat-file": request.neighbor_stat_file, **models}
    )
    fresh = not (request.restart or training.get("restart"))
    check_run_outputs(request.output_dir, config, path, ensemble, inputs, fresh)
    check_layout(request.output_dir, training, ensemble)


def _finished_marker(out_dir: str) -> str:
    return os.path.join(out_dir, FINISHED_MARKER)


def run_training(request: TrainRequest) -> None:
    """Train as ``request`` asks; problems raise `MDTrainError`."""
    # SIGTERM/SIGUSR1 keep their default action (end the process, nothing to save) until the
    # training loop starts; from there until the very end they only set a flag
    preemption = PreemptionHandler()
    try:
        _train(request, preemption)
    finally:
        preemption.restore()


def _train(request: TrainRequest, preemption: PreemptionHandler) -> None:
    config = load_config(request.input_path)
    precision_source = _apply_precision_override(request, config)
    training = config["training"]
    ensemble = ensemble_size(request.ensemble, training)
    training["ensemble"] = ensemble  # out.json records what ran
    dist_cfg = training.get("distributed", {})
    backend = dist_rt.resolve_backend_request(request.backend, dist_cfg.get("backend"))
    with dist_rt.init_distributed(
        backend, bool(dist_cfg.get("fallback", True)), float(dist_cfg.get("timeout", 1800))
    ) as runtime:
        log.info(
            "mdtrain %s, torch %s: %d rank(s), backend %s, device %s, %d thread(s) per rank",
            __version__, torch.__version__, runtime.world_size, runtime.backend, runtime.device,
            torch.get_num_threads(),
        )  # fmt: skip
        out_dir = request.output_dir
        dist_rt.run_on_main(_prepare_outputs, request, config, ensemble)  # before any work
        # everything up to the statistics checks the input; nothing in out_dir changes before
        restart, init_model = _resolve_restart(request, training, out_dir, ensemble)
        dist_rt.run_on_main(check_ensemble, ensemble, config, request.input_path, runtime.device)
        created = dist_rt.run_on_main(make_output_dirs, out_dir, ensemble)
        try:
            _run(request, preemption, config, runtime, ensemble, precision_source, restart,
                 init_model)  # fmt: skip
        except BaseException:
            if runtime.is_main:  # a failed run leaves no empty folders behind
                remove_empty_dirs(created)
            raise


def _run(
    request: TrainRequest, preemption: PreemptionHandler, config: dict, runtime,
    ensemble: int, precision_source: str, restart: str | None, init_model: str | None,
) -> None:  # fmt: skip
    """The run after its outputs were checked and its restart point found."""
    training = config["training"]
    out_dir = request.output_dir
    if runtime.is_main:
        for message in (*one_sided_terms(config["loss"]), *inert_settings(config["model"])):
            log.warning("%s", message)
    if restart:  # a committee continues from member 0's of that step
        restart = member_checkpoints(restart, ensemble)[0]
    finetune = init_model if init_model and request.finetune else None
    init_model = None if finetune else init_model
    state = load_checkpoint(restart) if restart else None
    if init_model or finetune:
        state = load_model_file(init_model or finetune)
    if restart:
        _check_compatible(state, config["model"], restart)
        config["model"] = state["model_config"]  # sel and sizes of the run being continued
    elif init_model:
        config = _init_model_config(config, state, init_model)
    elif finetune:
        config = finetune_config(config, state, finetune)
    check_networks(training["mixed_precision"], config["model"], precision_source)
    data = open_datasets(config, request.input_path)
    check_samplers(config, request.input_path, data, runtime.world_size)
    dist_rt.run_on_main(validate_datasets, data)
    stat_file = training.get("stat_file")
    stat_file = resolve_path(request.input_path, stat_file) if stat_file else None
    if stat_file and not (restart or init_model):
        dist_rt.run_on_main(_check_stat_file, stat_file)
    min_nbor_dist = state.get("min_nbor_dist") if state else None
    collected = None  # data statistics gathered while the neighbour statistics search
    if not (restart or init_model or finetune):
        collected = stat_collector(config, data, stat_file, runtime.device)
    if not restart:
        config, found = resolve_sel_and_min_dist(
            config,
            request.input_path,
            data,
            request.neighbor_stat_file,
            request.skip_neighbor_stat,
            collected,
        )
        min_nbor_dist = found if found is not None else min_nbor_dist
    if finetune:
        config = pin_pretrained_sel(config, state)
    training = config["training"]  # resolve_model_sel returns a new config
    if training.get("seed") is None:
        training["seed"] = dist_rt.run_on_main(_random_seed)  # the same on every rank
        log.info(
            "training.seed is not set: drew %d (written to out.json; set it to repeat "
            "this run)", training["seed"],
        )  # fmt: skip
    config = _committee_seeds(config, ensemble)
    seed_everything(int(training["seed"]))
    keep_freed_memory()
    precision = mode_of(training.get("mixed_precision"))
    sampling = _committee_sampling(state if restart else None, init_model or finetune, ensemble)
    members = [member_config(config, k, sampling) for k in range(ensemble)]
    model = build_models([m["model"] for m in members], runtime.device, precision)
    models = members_of(model)
    first = models[0]
    if init_model:
        _load_weights(first, state, init_model)
    elif finetune:
        nbatch = int(config["model"].get("data_stat_nbatch", 10))
        dist_rt.run_on_main(load_pretrained, first, state, data.train, nbatch)
    elif not restart:
        nbatch = int(config["model"].get("data_stat_nbatch", 10))
        model_statistics(first, data.train, stat_file, nbatch, stat_mode(config), collected)
    if not restart:
        _share_start(models, same_weights=bool(init_model or finetune))
    dist_rt.broadcast_module(model)
    # every frame's neighbour counts checked against the stat file's, and sel if strict
    from_file = not (restart or request.skip_neighbor_stat)
    limit = neighbor_limit(config, request.input_path, request.neighbor_stat_file, from_file)
    cache = NeighborListCache(limit=limit)
    trainer = Trainer(
        config, model, data.train, data.valid, runtime, out_dir, cache, sampling,
        {"min_nbor_dist": min_nbor_dist},
    )  # fmt: skip
    if restart:
        paths = member_checkpoints(restart, ensemble)
        trainer.load_state_dicts([state] + [load_checkpoint(p) for p in paths[1:]])
        whom = "" if ensemble == 1 else "the committee "
        log.info("continuing %sfrom %s at step %d", whom, restart, trainer.step)
    if runtime.is_main:
        dump_config(config, output_path(out_dir, "out.json"))
        for member in trainer.members:  # each member's input, a single run's
            if member.out_dir != out_dir:
                dump_config(member.config, output_path(member.out_dir, "out.json"))
        with contextlib.suppress(FileNotFoundError):  # a marker of an earlier, shorter run
            os.remove(_finished_marker(out_dir))
    nparams = sum(p.numel() for p in first.parameters())
    log.info(
        "%s: %d parameters%s; training for %d steps",
        "model" if ensemble == 1 else f"committee of {ensemble} models ({sampling} sampling)",
        nparams, "" if ensemble == 1 else " each", trainer.numb_steps,
    )  # fmt: skip
    result = trainer.run(append_lcurve=bool(restart), preemption=preemption.install())
    if result.preempted:
        log.info(
            "preempted at step %d of %d: checkpoint %s written; the run is unfinished, "
            "continue it with `mdtrain train ... --restart auto`",
            result.step, trainer.numb_steps, result.checkpoint,
        )  # fmt: skip
    else:
        if runtime.is_main:
            _write_marker(_finished_marker(out_dir), result.step)
        log.info("finished at step %d", result.step)


def _random_seed() -> int:
    return secrets.randbits(31)


def _committee_seeds(config: dict, size: int) -> dict:
    """``config`` with a model seed for every null one in a committee: one base seed drawn
    (the same on every rank) and logged; member k uses base + k (it is written to out.json).
    A single run keeps its null seeds."""
    if size == 1:
        return config
    config = copy.deepcopy(config)
    missing = [
        (where, net[s])
        for where, net in network_sections(config["model"])  # a linear_ener's parts too
        for s in ("descriptor", "fitting_net")
        if net[s].get("seed") is None
    ]
    if not missing:
        return config
    base = dist_rt.run_on_main(_random_seed)
    for _, section in missing:
        section["seed"] = base
    log.info(
        "%s seed not set: drew %d for the committee (member k uses %d + k; written to "
        "out.json)", " and ".join(sorted({w for w, _ in missing})), base, base,
    )  # fmt: skip
    return config


def _committee_sampling(restart_state: dict | None, start_model: str | None, size: int) -> str:
    """How the members draw their frames: from the checkpoint being continued, else
    "per-member" when they all start from one model's weights, "shared" otherwise (a single
    run: "shared", its one member is the input's run)."""
    if size == 1:
        return SHARED
    if restart_state is not None:
        saved = restart_state.get("committee")
        if not saved:
            raise MDTrainError("--restart: the checkpoint is not a committee member's")
        if int(saved["size"]) != size:
            raise MDTrainError(
                f"--restart: the checkpoints are of a committee of {saved['size']}, not {size}"
            )
        return str(saved["sampling"])
    return PER_MEMBER if start_model else SHARED


def _share_start(models: list, same_weights: bool) -> None:
    """Member 0's statistics (or, starting from one model, all its weights) in every member."""
    if same_weights:
        state = models[0].state_dict()
        for member in models[1:]:
            member.load_state_dict(state)
    else:
        share_statistics(models)


def _write_marker(path: str, step: int) -> None:
    """``<out>/finished`` holding the final step: job scripts test it to stop resubmitting."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(f"{step}\n")
    os.replace(tmp, path)
