"""``training.distributed.stat_mode: "shard"``: every rank computes the statistics of its share
of the frames and the ranks combine them. Checked in real Gloo processes (2 and 3 ranks)
against one process computing everything: neighbour counts, minimum distance and the other
per-system neighbour figures exactly, davg/dstd and the energy bias to 1e-10 relative; the
statistics batches are those of one process, divided; a stat file is still written once and,
when complete, read without computing anything."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from mdtrain.config import load_config
from mdtrain.data import open_system
from mdtrain.data.share import share_ranges
from mdtrain.errors import MDTrainError
from mdtrain.model import EnergyModel
from mdtrain.model.stats import collect_stat_batches, compute_or_load_stats
from mdtrain.neighbors.sel import resolve_sel
from mdtrain.neighbors.stat import compute_neighbor_stat, neighbor_stat_partial
from tests.helpers.datagen import lj_labels, random_water_like, write_npy_system
from tests.helpers.models import small_config
from tests.helpers.processes import clean_env, run_process, run_workers, torchrun_command
from tests.helpers.training import load_params, make_project, tiny_config

RCUT = 3.5
NBATCH = 2  # the statistics sample part of the frames: 2 batches of each system
TYPE_MAP = ["O", "H"]


def write_systems(root) -> list[str]:
    """Three systems of three compositions (the energy-bias fit has full rank): periodic
    water, periodic water missing one H, and a non-periodic cluster with an extra O that
    is near the others in the first two frames and alone (no neighbour) afterwards."""
    paths = []
    coords, types, boxes = random_water_like(7, 8, 6.4, seed=1)
    energy, _, _ = lj_labels(coords, types, boxes, 4.0)
    paths.append(write_npy_system(root / "water", coords, types, TYPE_MAP, boxes, energy))

    coords, types, boxes = random_water_like(5, 4, 5.4, seed=2, triclinic=True)
    coords, types = coords[:, :-1], types[:-1]
    energy, _, _ = lj_labels(coords, types, boxes, 4.0)
    paths.append(write_npy_system(root / "short", coords, types, TYPE_MAP, boxes, energy))

    coords, types, _ = random_water_like(6, 6, 6.0, seed=3)
    extra = coords[:, :1] + np.array([0.0, 0.0, 2.2])
    extra[2:] += 40.0  # beyond rcut of everything from frame 2 on
    coords = np.concatenate([coords, extra], axis=1)
    types = np.append(types, 0)
    energy, _, _ = lj_labels(coords, types, None, 4.0)
    paths.append(write_npy_system(root / "cluster", coords, types, TYPE_MAP, None, energy))
    return paths


def model_config() -> dict:
    return small_config({"rcut": RCUT, "sel": [12, 24]})


def statistics_of(model: EnergyModel) -> dict[str, np.ndarray]:
    return {
        "davg": model.descriptor.davg.detach().cpu().numpy().copy(),
        "dstd": model.descriptor.dstd.detach().cpu().numpy().copy(),
        "bias": model.out_bias.detach().cpu().numpy().copy(),
        "std": model.out_std.detach().cpu().numpy().copy(),
    }


def batch_keys(batches: list[dict]) -> list[tuple[str, int, float]]:
    """What identifies a statistics batch: its system, frames and first coordinate."""
    return [(b["system"], len(b["coord"]), float(b["coord"][0, 0, 0])) for b in batches]


def _shard_worker(paths: list[str], stat_file: str) -> dict:
    """One rank: the statistics in "shard" mode, as training computes them."""
    import mdtrain.model.stats as stats_module
    from mdtrain import distributed as D
    from mdtrain.model.stats import StatShare
    from mdtrain.train.prepare import (
        combine_neighbor_partials,
        model_statistics,
        neighbor_figures,
    )

    with D.init_distributed("gloo", timeout_s=60) as rt:
        systems = [open_system(p, TYPE_MAP) for p in paths]
        out: dict = {"rank": rt.rank}
        out["min_dist"], out["max_size"] = neighbor_figures(systems, RCUT, 2, "shard")
        out["total"] = neighbor_figures(systems, RCUT, 2, "shard", mixed=True)[1]
        rows = share_ranges([(s.nframes, s.natoms) for s in systems], rt.rank, rt.world_size)
        mine = neighbor_stat_partial(systems, RCUT, 2, progress=False, rows=rows)
        out["searched"] = int(mine.searched.sum())
        out["partial"] = vars(combine_neighbor_partials(mine))
        share = StatShare(rt.rank, rt.world_size)
        out["batches"] = batch_keys(
            collect_stat_batches(systems, model_config(), NBATCH, share=share)
        )
        model = EnergyModel(model_config())
        model_statistics(model, systems, None, NBATCH, "shard")
        out["stats"] = statistics_of(model)
        # with a stat file: computed, written once (rank 0), then read without any batch
        model_statistics(EnergyModel(model_config()), systems, stat_file, NBATCH, "shard")
        calls = []
        original = stats_module.collect_stat_batches
        stats_module.collect_stat_batches = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            again = EnergyModel(model_config())
            model_statistics(again, systems, stat_file, NBATCH, "shard")
        finally:
            stats_module.collect_stat_batches = original
        out["reloaded"] = statistics_of(again)
        out["batches_when_reloading"] = len(calls)
        return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The systems, and the statistics of one process computing everything."""
    root = tmp_path_factory.mktemp("shard-stats")
    paths = write_systems(root)
    systems = [open_system(p, TYPE_MAP) for p in paths]
    model = EnergyModel(model_config())
    compute_or_load_stats(model, systems, None, NBATCH)
    return {
        "root": root,
        "paths": paths,
        "frames": sum(s.nframes for s in systems),
        "neighbors": compute_neighbor_stat(systems, RCUT, 2, progress=False),
        "partial": vars(neighbor_stat_partial(systems, RCUT, 2, progress=False)),
        "batches": batch_keys(collect_stat_batches(systems, model_config(), NBATCH)),
        "stats": statistics_of(model),
    }


def test_reference_data_exercise_every_figure(data):
    """The data make the comparison mean something: a lonely atom from frame 2 of one
    system, three compositions, part of the frames sampled."""
    partial = data["partial"]
    assert partial["lonely"].tolist() == [0, 0, 4] and partial["first_lonely"][2] == 2
    assert len(data["batches"]) == 6 and sum(n for _, n, _ in data["batches"]) < data["frames"]
    assert np.all(np.diff(data["stats"]["bias"]) != 0) and data["stats"]["std"][0] > 1e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_shard_statistics_equal_one_process(data, world):
    stat_file = str(data["root"] / f"stat-{world}.h5")
    results = run_workers(_shard_worker, world, args=(data["paths"], stat_file), timeout=90)
    reference = data["stats"]
    for out in results:
        # neighbour statistics: exact, on every rank
        assert out["min_dist"] == data["neighbors"].min_nbor_dist
        assert out["max_size"] == data["neighbors"].max_nbor_size
        assert out["total"] == [data["neighbors"].max_nbor_total]  # all types together
        for name, value in data["partial"].items():
            assert np.array_equal(out["partial"][name], value), name
        # descriptor moments and energy bias: every rank alike, one process's to 1e-10
        for name, value in reference.items():
            np.testing.assert_allclose(out["stats"][name], value, rtol=1e-10, atol=0, err_msg=name)
            np.testing.assert_array_equal(out["stats"][name], results[0]["stats"][name])
            np.testing.assert_array_equal(out["reloaded"][name], out["stats"][name])
        assert out["batches_when_reloading"] == 0
    # the work was divided: each rank searched part of the frames, all of them once
    searched = [out["searched"] for out in results]
    assert sum(searched) == data["frames"] and min(searched) > 0 and max(searched) < data["frames"]
    assert [key for out in results for key in out["batches"]] == data["batches"]
    assert all(out["batches"] for out in results)
    # the stat file holds the combined figures (written by rank 0 alone)
    with h5py.File(stat_file, "r") as handle:
        root = handle[" ".join(TYPE_MAP)]
        np.testing.assert_allclose(
            root["bias_atom_energy"][()].ravel(), reference["bias"], rtol=1e-10, atol=0
        )


@pytest.mark.multiprocess
@pytest.mark.slow  # about 13 s; the figures themselves are checked above in the default run
def test_training_run_with_shard_statistics(tmp_path):
    """``mdtrain train`` under torchrun (2 ranks) with ``stat_mode: "shard"``: sel and the
    model's statistics are those of one process; the figures are logged once."""
    inp = make_project(tmp_path, numb_steps=1, distributed={"stat_mode": "shard"})
    out = tmp_path / "out"
    cmd = torchrun_command("mdtrain", ["train", str(inp), "-o", str(out)], 2, extra=["-m"])
    run = run_process(cmd, 120, clean_env(), cwd=tmp_path).check()
    assert run.stderr.count("neighbour statistics: min distance") == 1, run.stderr
    assert "[rank 1]" not in run.stderr, run.stderr  # no warning twice
    config = json.loads((out / "out.json").read_text())
    train = [open_system(str(tmp_path / "data" / n), TYPE_MAP) for n in ("train_a", "train_b")]
    every = [*train, open_system(str(tmp_path / "data" / "valid"), TYPE_MAP)]
    counts = compute_neighbor_stat(every, 4.0, 2, progress=False).max_nbor_size
    assert config["model"]["descriptor"]["sel"] == resolve_sel("auto", counts)
    model = EnergyModel(config["model"])
    compute_or_load_stats(model, train, None, config["model"]["data_stat_nbatch"])
    state = load_params(out / "model.ckpt-1.pt")
    for name, value in model.state_dict().items():
        if name.endswith(("davg", "dstd", "out_bias", "out_std")):
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=0, err_msg=name)


def test_shard_in_one_process_is_the_default_computation(data):
    """Without a process group "shard" is the one-process computation itself."""
    from mdtrain.train.prepare import model_statistics, neighbor_figures

    systems = [open_system(p, TYPE_MAP) for p in data["paths"]]
    assert neighbor_figures(systems, RCUT, 2, "shard") == (
        data["neighbors"].min_nbor_dist,
        data["neighbors"].max_nbor_size,
    )
    model = EnergyModel(model_config())
    model_statistics(model, systems, None, NBATCH, "shard")
    for name, value in statistics_of(model).items():
        np.testing.assert_array_equal(value, data["stats"][name])


def test_share_ranges_cover_every_item_once():
    groups = [(7, 24), (0, 5), (5, 11), (1, 1000), (6, 19)]
    for world in (1, 2, 3, 4, 7, 40):
        shares = [share_ranges(groups, rank, world) for rank in range(world)]
        for g, (count, _) in enumerate(groups):
            taken = [i for share in shares for i in share[g]]
            assert taken == list(range(count))  # in order, each once: contiguous shares
        loads = [sum(len(r) * w for r, (_, w) in zip(s, groups, strict=True)) for s in shares]
        total = sum(c * w for c, w in groups)
        assert sum(loads) == total
        assert all(abs(load - total / world) <= 1000 for load in loads)  # within one item
    with pytest.raises(ValueError):
        share_ranges(groups, 2, 2)


def test_bad_stat_mode_names_the_key(tmp_path):
    path = tmp_path / "input.json"
    path.write_text(json.dumps(tiny_config(distributed={"stat_mode": "shards"})))
    with pytest.raises(MDTrainError, match=r"training\.distributed\.stat_mode"):
        load_config(str(path))
    path.write_text(json.dumps(tiny_config(distributed={"stat_mode": "shard"})))
    assert load_config(str(path))["training"]["distributed"]["stat_mode"] == "shard"
    path.write_text(json.dumps(tiny_config()))
    assert load_config(str(path))["training"]["distributed"]["stat_mode"] == "rank0"
