"""Output statistics of DOS and property models (DeePMD-kit's ``compute_output_stats``)
against formulas written out here: per-type mean and std of atomic labels; the least-squares
per-type bias of frame labels from the normal equations and the std of its residual; the
intensive and the type-blind (``distinguish_types`` false) variants; atomic statistics
filled by frame ones for a type without atomic labels."""

from __future__ import annotations

import numpy as np
import pytest

from mdtrain.data import open_system
from mdtrain.data.labels import output_labels
from mdtrain.model.invariant import InvariantModel
from mdtrain.model.stats.output_stats import output_stats
from tests.helpers.datagen import random_water_like, write_npy_system
from tests.helpers.models import small_config


def _model(fitting: dict) -> InvariantModel:
    cfg = small_config(fitting={"neuron": [8], **fitting})
    cfg["fitting_net"].pop("resnet_dt")
    return InvariantModel(cfg)


def _systems(tmp_path, model, labels_of, sizes=((4, 2), (5, 3), (3, 4))):
    """Systems of ``nmol`` molecules (the second without its last hydrogen, so that the
    compositions are not proportional) with labels ``labels_of(nf, natoms, types, seed)``."""
    outputs = output_labels(model.get_model_config())
    systems = []
    for k, (nf, nmol) in enumerate(sizes):
        coords, types, boxes = random_water_like(nf, nmol, 6.0, seed=k)
        if k == 1:
            coords, types = coords[:, :-1], types[:-1]
        extra = labels_of(nf, len(types), types, k)
        path = write_npy_system(tmp_path / f"s{k}", coords, types, ["O", "H"], boxes, extra=extra)
        systems.append(open_system(path, ["O", "H"], outputs))
    return systems, [(i, 0, s.nframes) for i, s in enumerate(systems)]


def _counts(systems) -> np.ndarray:
    return np.concatenate(
        [np.tile(np.bincount(s.atype, minlength=2), (s.nframes, 1)) for s in systems]
    ).astype(float)


def test_atomic_labels_give_per_type_mean_and_std(tmp_path):
    model = _model({"type": "dos", "numb_dos": 3})
    rng = np.random.default_rng(0)
    systems, plan = _systems(
        tmp_path, model, lambda nf, n, t, k: {"atom_dos": rng.normal(size=(nf, n, 3)) + t[:, None]}
    )
    bias, std = output_stats(model, systems, plan)
    for t in range(2):
        rows = np.concatenate(
            [
                s.frames(range(s.nframes))["atom_dos"][:, s.atype == t].reshape(-1, 3)
                for s in systems
            ]
        )
        np.testing.assert_allclose(bias[t], rows.mean(0), rtol=1e-12)
        np.testing.assert_allclose(std[t], np.sqrt(((rows - rows.mean(0)) ** 2).mean(0)))


@pytest.mark.parametrize("intensive", [False, True])
def test_frame_labels_give_least_squares_bias(tmp_path, intensive):
    model = _model({"type": "property", "property_name": "gap", "task_dim": 2})
    model.intensive = intensive
    rng = np.random.default_rng(1)
    systems, plan = _systems(tmp_path, model, lambda nf, n, t, k: {"gap": rng.normal(size=(nf, 2))})
    bias, std = output_stats(model, systems, plan)
    a = _counts(systems)
    if intensive:
        a = a / a.sum(1, keepdims=True)
    y = np.concatenate([s.frames(range(s.nframes))["gap"] for s in systems])
    want = np.linalg.solve(a.T @ a, a.T @ y)  # the normal equations
    np.testing.assert_allclose(bias, want, rtol=1e-9)
    residual = y - a @ want
    np.testing.assert_allclose(std, np.tile(residual.std(0), (2, 1)), rtol=1e-9)


def test_type_blind_statistics_are_one_mean_per_atom(tmp_path):
    model = _model({"type": "property", "property_name": "gap", "distinguish_types": False})
    rng = np.random.default_rng(2)
    systems, plan = _systems(tmp_path, model, lambda nf, n, t, k: {"gap": rng.normal(size=(nf, 1))})
    bias, std = output_stats(model, systems, plan)
    per_atom = np.concatenate(
        [s.frames(range(s.nframes))["gap"] / s.natoms for s in systems]
    ).ravel()
    np.testing.assert_allclose(bias, np.full((2, 1), per_atom.mean()), rtol=1e-12)
    np.testing.assert_allclose(std, np.full((2, 1), per_atom.std()), rtol=1e-12)


def test_a_type_without_atomic_labels_takes_the_frame_statistics(tmp_path):
    model = _model({"type": "dos", "numb_dos": 2})
    outputs = output_labels(model.get_model_config())
    rng = np.random.default_rng(3)
    coords, types, boxes = random_water_like(3, 4, 6.0, seed=5)
    oxygens = types == 0  # a system of oxygens only, with atomic labels
    atomic = rng.normal(size=(3, int(oxygens.sum()), 2))
    path_a = write_npy_system(
        tmp_path / "a", coords[:, oxygens], types[oxygens], ["O", "H"], boxes,
        extra={"atom_dos": atomic},
    )  # fmt: skip
    frame = rng.normal(size=(3, 2)) * 5
    path_b = write_npy_system(
        tmp_path / "b", coords, types, ["O", "H"], boxes, extra={"dos": frame}
    )
    systems = [open_system(p, ["O", "H"], outputs) for p in (path_a, path_b)]
    bias, std = output_stats(model, systems, [(0, 0, 3), (1, 0, 3)])
    np.testing.assert_allclose(bias[0], atomic.reshape(-1, 2).mean(0), rtol=1e-12)
    np.testing.assert_allclose(std[0], atomic.reshape(-1, 2).std(0), rtol=1e-12)
    a = _counts(systems[1:])
    frame_bias = np.linalg.pinv(a) @ frame  # the minimum-norm least-squares solution
    np.testing.assert_allclose(bias[1], frame_bias[1], rtol=1e-9)
    np.testing.assert_allclose(std[1], (frame - a @ frame_bias).std(0), atol=1e-9)


def test_no_labels_leave_zero_bias_and_unit_std(tmp_path):
    model = _model({"type": "dos", "numb_dos": 2})
    systems, plan = _systems(tmp_path, model, lambda nf, n, t, k: {}, sizes=((2, 2),))
    bias, std = output_stats(model, systems, plan)
    assert not bias.any() and (std == 1).all()
