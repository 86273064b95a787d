"""``mdtrain train``: set up the run (launcher, device, data, statistics, model), then train."""

from __future__ import annotations

import argparse
import logging
import os

import torch

from mdtrain import __version__
from mdtrain import distributed as dist_rt
from mdtrain.config import dump_config, load_config, resolve_path
from mdtrain.errors import MDTrainError
from mdtrain.model.energy import EnergyModel
from mdtrain.model.stats import compute_or_load_stats
from mdtrain.train.checkpoint import CheckpointManager, load_checkpoint
from mdtrain.train.loop import Trainer, seed_everything
from mdtrain.train.prepare import open_datasets, output_path, resolve_model_sel

log = logging.getLogger("mdtrain")


def _restart_path(restart: str | None, out_dir: str, training: dict) -> str | None:
    """``--restart auto``: the newest valid checkpoint in the output directory, if any."""
    if restart != "auto":
        return restart
    manager = CheckpointManager(out_dir, training["save_ckpt"], int(training["max_ckpt_keep"]))
    path = dist_rt.run_on_main(manager.latest)
    log.info("restart auto: %s", path or "no checkpoint found, starting fresh")
    return path


def _check_compatible(state: dict, model_config: dict, path: str) -> None:
    old = state["model_config"]
    for key in ("type_map",):
        if old.get(key) != model_config.get(key):
            raise MDTrainError(
                f"checkpoint {path}: {key} {old.get(key)} differs from the input's {model_config.get(key)}"
            )


def run_train(args: argparse.Namespace) -> int:
    config = load_config(args.input)
    training = config["training"]
    dist_cfg = training.get("distributed", {})
    backend = dist_rt.resolve_backend_request(args.backend, dist_cfg.get("backend"))
    with dist_rt.init_distributed(
        backend, bool(dist_cfg.get("fallback", True)), float(dist_cfg.get("timeout", 1800))
    ) as runtime:
        log.info(
            "mdtrain %s, torch %s: %d rank(s), backend %s, device %s, %d thread(s) per rank",
            __version__, torch.__version__, runtime.world_size, runtime.backend, runtime.device,
            torch.get_num_threads(),
        )  # fmt: skip
        out_dir = args.output_dir
        if runtime.is_main:
            os.makedirs(out_dir, exist_ok=True)
        restart = _restart_path(args.restart or training.get("restart"), out_dir, training)
        if restart and args.init_model:
            raise MDTrainError("--restart and --init-model exclude each other")
        state = (
            load_checkpoint(restart or args.init_model) if (restart or args.init_model) else None
        )
        data = open_datasets(config, args.input)
        if restart:
            config["model"] = state["model_config"]  # sel and sizes of the run being continued
            _check_compatible(state, config["model"], restart)
        else:
            config = resolve_model_sel(
                config, args.input, data, args.neighbor_stat_file, args.skip_neighbor_stat
            )
        seed_everything(int(training.get("seed") or 0))
        model = EnergyModel(config["model"]).to(runtime.device)
        if args.init_model:
            _check_compatible(state, config["model"], args.init_model)
            try:
                model.load_state_dict(state["model_state"])
            except RuntimeError as exc:
                raise MDTrainError(
                    f"checkpoint {args.init_model}: weights do not fit this model "
                    f"({str(exc).splitlines()[0]})"
                ) from None
        elif not restart:
            stat_file = training.get("stat_file")
            if stat_file:
                stat_file = resolve_path(args.input, stat_file)
            nbatch = int(config["model"].get("data_stat_nbatch", 10))
            dist_rt.run_on_main(compute_or_load_stats, model, data.train, stat_file, nbatch)
        dist_rt.broadcast_module(model)
        if runtime.is_main:
            dump_config(config, output_path(out_dir, "out.json"))
        trainer = Trainer(config, model, data.train, data.valid, runtime, out_dir)
        if restart:
            trainer.load_state_dict(state)
            log.info("continuing from %s at step %d", restart, trainer.step)
        nparams = sum(p.numel() for p in model.parameters())
        log.info("model: %d parameters; training for %d steps", nparams, trainer.numb_steps)
        result = trainer.run(append_lcurve=bool(restart))
        log.info("finished at step %d%s", result.step, " (preempted)" if result.preempted else "")
    return 0
