"""``mdtrain show``: dp show's lines for a checkpoint and the same model as a ``.dp`` file."""

from __future__ import annotations

from mdtrain.cli import main
from tests.helpers.models import make_model, save_tiny_checkpoint


def test_show_prints_dp_show_lines(tmp_path, capsys):
    model = make_model()
    checkpoint = save_tiny_checkpoint(tmp_path / "model.pt", model)
    descriptor = sum(p.numel() for p in model.descriptor.parameters())
    fitting = sum(p.numel() for p in model.fitting.parameters())
    assert main(["show", checkpoint]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["This is a singletask model", "The type_map is ['O', 'H']"]
    assert lines[2].startswith("The descriptor parameter is {'type': 'se_e2_a'")
    assert f"Parameters in descriptor: {descriptor:,}" in lines
    assert f"Parameters in total: {descriptor + fitting:,}" in lines
    assert lines[-2:] == ["The rcut is 3.5", "The sel is [12, 24]"]
    dp = str(tmp_path / "model.dp")
    assert main(["freeze", checkpoint, "-o", dp]) == 0
    capsys.readouterr()
    assert main(["show", dp, "type-map", "observed-type"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "The type_map is ['O', 'H']",
        "The observed types for this model: ",
        "Number of observed types: 2 ",
        "Observed types: ['O', 'H'] ",
    ]
    assert main(["show", dp, "model-branch"]) == 1
    assert main(["show", dp, "serialization-tree"]) == 1
    assert "dp show" in capsys.readouterr().err
    assert main(["show", dp, "colour"]) == 1
    assert "unknown attribute 'colour'" in capsys.readouterr().err
