"""``mdtrain change-bias`` of DOS and property models (DeePMD-kit's ``change_out_bias``):
``-m change`` shifts each type's bias by the mean atomic residual (after it the residuals of
every type average zero) and takes their standard deviation; ``-m set`` is the least-squares
fit of the frame labels; a ``.dp`` file is changed as a checkpoint is; ``-b`` is refused."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.data.labels import output_labels
from mdtrain.errors import MDTrainError
from mdtrain.infer.load import load_model
from tests.helpers.models import evaluate
from tests.helpers.output_data import make_output_project


def _residuals(model, path):
    """Per type, the atomic residuals (label - prediction) of all frames of ``path``."""
    system = open_system(str(path), ["O", "H"], output_labels(model.get_model_config()))
    frames = system.frames(range(system.nframes))
    out = [
        evaluate(model, c, b, system.atype)["atom_dos"]
        for c, b in zip(frames["coord"], frames["box"])
    ]  # noqa: E501
    diff = frames["atom_dos"].reshape(len(out), system.natoms, -1) - np.stack(out)
    return [diff[:, system.atype == t].reshape(-1, diff.shape[-1]) for t in range(2)], system


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("dos")
    inp = make_output_project(root, "dos", numb_steps=2)
    assert main(["train", str(inp), "-o", str(root / "out")]) == 0
    return root


def test_change_zeroes_the_mean_atomic_residual(trained, tmp_path):
    before = load_model(trained / "out" / "model.ckpt.pt")
    res, _ = _residuals(before, trained / "data" / "valid")
    out = tmp_path / "changed.pt"
    args = [
        "change-bias",
        str(trained / "out" / "model.ckpt.pt"),
        "-s",
        str(trained / "data" / "valid"),
    ]
    assert main([*args, "-m", "change", "-o", str(out)]) == 0
    after = load_model(out)
    for t in range(2):
        np.testing.assert_allclose(
            after.out_bias[t].numpy(), before.out_bias[t].numpy() + res[t].mean(0), atol=1e-10
        )
        np.testing.assert_allclose(after.out_std[t].numpy(), res[t].std(0), atol=1e-10)
    new, _ = _residuals(after, trained / "data" / "valid")
    assert max(np.abs(r.mean(0)).max() for r in new) < 1e-9


def test_set_fits_the_frame_labels_and_dp_files_change_too(trained, tmp_path):
    assert (
        main(["freeze", "-c", str(trained / "out" / "model.ckpt.pt"), "-o", str(tmp_path / "m.dp")])
        == 0
    )  # noqa: E501
    out = tmp_path / "set.dp"
    args = ["change-bias", str(tmp_path / "m.dp"), "-s", str(trained / "data" / "global")]
    assert main([*args, "-m", "set", "-o", str(out)]) == 0
    model = load_model(out)
    labels = output_labels(model.get_model_config())
    system = open_system(str(trained / "data" / "global"), ["O", "H"], labels)
    y = system.frames(range(system.nframes), labels=("dos",), positions=False)["dos"]
    counts = np.tile(np.bincount(system.atype, minlength=2), (len(y), 1)).astype(float)
    want = np.linalg.lstsq(counts, y, rcond=None)[0]
    np.testing.assert_allclose(model.out_bias.numpy(), want, atol=1e-9)


def test_given_values_are_refused(trained):
    args = ["change-bias", str(trained / "out" / "model.ckpt.pt"), "-b", "1.0", "2.0"]
    with pytest.raises(MDTrainError, match="only an energy model's bias can be given"):
        from mdtrain.cli import build_parser
        from mdtrain.commands.change_bias import run_change_bias

        run_change_bias(build_parser().parse_args(args))
