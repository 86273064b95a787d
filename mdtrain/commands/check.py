"""``mdtrain check input.json``: print every problem of the input and its systems (found by
`mdtrain.check`) or an OK summary."""

from __future__ import annotations

import argparse

from mdtrain.check import check_config, read_input
from mdtrain.errors import MDTrainError


def run_check(args: argparse.Namespace) -> int:
    """Print every problem (one per line) or an OK summary; exit status 1 on any problem."""
    try:
        data = read_input(args.input)
    except MDTrainError as exc:
        print(exc)
        return 1
    report = check_config(data, args.input)
    for problem in report.problems:
        print(problem)
    print(report.summary())
    return 1 if report.problems else 0
