"""``mdtrain train``: the arguments become a `TrainRequest` for `mdtrain.train.run`."""

from __future__ import annotations

import argparse

from mdtrain.train.run import TrainRequest, run_training


def run_train(args: argparse.Namespace) -> int:
    """Entry point of ``mdtrain train INPUT [-o DIR] [--restart CKPT | --init-model M |
    --finetune M] [--ensemble N]``."""
    run_training(
        TrainRequest(
            input_path=args.input,
            output_dir=args.output_dir,
            restart=args.restart,
            init_model=args.init_model,
            finetune=args.finetune,
            backend=args.backend,
            mixed_precision=args.mixed_precision,
            neighbor_stat_file=args.neighbor_stat_file,
            skip_neighbor_stat=args.skip_neighbor_stat,
            ensemble=args.ensemble,
        )
    )
    return 0
