"""``mdtrain show MODEL [ATTRIBUTES...]``: a model's type map, networks, cutoff and size, as
DeePMD-kit's ``dp show`` words them (`mdtrain.infer.show`)."""

from __future__ import annotations

import argparse

from mdtrain.infer.load import load_model
from mdtrain.infer.show import DEFAULT, describe


def run_show(args: argparse.Namespace) -> int:
    """Entry point of ``mdtrain show MODEL [ATTRIBUTES...]`` (all but the multitask and
    observed-type ones when none is named)."""
    model = load_model(args.model)
    for line in describe(model, list(args.attributes or DEFAULT)):
        print(line)
    return 0
