"""The same model in two files (a checkpoint and its frozen or exported form) must give the
same figures through the commands, and combined models with random statistics to freeze."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.model.combined_build import build_combined_model
from tests.helpers.committee import read_model_devi
from tests.helpers.models import set_random_stats


def assert_same_test_figures(first: str, second: str, system: str, tmp_path: Path) -> dict:
    """``mdtrain test`` of both files on ``system``: the same figures to 1e-12; returns them."""
    figures = []
    for path in (first, second):
        out = tmp_path / "res.json"
        assert main(["test", "-m", path, "-s", system, "--json", str(out)]) == 0
        figures.append(json.loads(out.read_text())["total"])
    assert figures[1].keys() == figures[0].keys()
    for key, value in figures[0].items():
        assert figures[1][key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    return figures[0]


def assert_same_model_devi(first: str, second: str, other: str, system: str, tmp_path) -> None:
    """``mdtrain model-devi`` of each file with ``other``: the same file, the models differ."""
    texts = []
    for path in (first, second):
        out = tmp_path / f"devi-{len(texts)}.out"
        assert main(["model-devi", "-m", path, other, "-s", system, "-o", str(out)]) == 0
        texts.append(out.read_text())
    assert texts[1] == texts[0]
    assert np.all(read_model_devi(out)[0][2][:, 4] > 0)


def random_combined_model(config: dict):
    """A combined model of ``config``, each part with a descriptor given random statistics,
    an output bias set, in eval mode."""
    model = build_combined_model(config)
    for k, part in enumerate(model.parts):
        if hasattr(part, "descriptor"):
            set_random_stats(part, seed=k)
    model.set_out_bias([0.3, -0.2])
    return model.eval()
