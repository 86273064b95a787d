"""Descriptor statistics, energy bias, sampling and the HDF5 stat file."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch

from mdtrain.model import EnergyModel
from mdtrain.model.stat_file import descriptor_stat_hash
from mdtrain.model.stats import (
    PairStatSums,
    StatCollector,
    collect_stat_batches,
    compute_energy_bias,
    compute_or_load_stats,
    stat_batch_plan,
    stream_stat_inputs,
)
from tests.helpers.models import small_config
from tests.helpers.padded_stats import compute_descriptor_stats, descriptor_stat_items
from tests.helpers.reference import ref_neighbours, ref_switch
from tests.helpers.stat_systems import make_system


def direct_stats(systems, frames_per_system, rcut, rcut_smth, sel, ntypes):
    """Brute-force numpy davg/dstd, padded slots counted as zeros."""
    r_vals = {t: [] for t in range(ntypes)}
    a_vals = {t: [] for t in range(ntypes)}
    for system, nf in zip(systems, frames_per_system, strict=True):
        for f in range(nf):
            box = None if system.box is None else system.box[f]
            neigh = ref_neighbours(system.coord[f], box, system.atype, rcut, sel)
            for i, blocks in enumerate(neigh):
                rows = []
                for t in range(ntypes):
                    block = np.zeros((sel[t], 4))
                    for k, (r, d, _) in enumerate(blocks[t]):
                        block[k] = ref_switch(r, rcut_smth, rcut) * np.array([1 / r, *(d / r**2)])
                    rows.append(block)
                rows = np.concatenate(rows)
                r_vals[system.atype[i]].append(rows[:, 0])
                a_vals[system.atype[i]].append(rows[:, 1:].ravel())
    nnei = sum(sel)
    davg, dstd = np.zeros((ntypes, nnei, 4)), np.ones((ntypes, nnei, 4))
    for t in range(ntypes):
        if not r_vals[t]:
            dstd[t] = 0.1
            continue
        r, a = np.concatenate(r_vals[t]), np.concatenate(a_vals[t])
        davg[t, :, 0] = r.mean()
        dstd[t, :, 0] = max(r.std(), 1e-2)
        dstd[t, :, 1:] = max(a.std(), 1e-2)
    return davg, dstd


def test_davg_dstd_match_numpy():
    systems = [make_system(3, True, 3, seed=1), make_system(2, False, 2, seed=2)]
    cfg = small_config()
    model = EnergyModel(cfg)
    # natoms 9 and 6: auto batch size ceil(32/9) = 4 and ceil(32/6) = 6 frames
    batches = collect_stat_batches(systems, cfg, nbatch=10)
    assert [len(b["coord"]) for b in batches] == [3, 2]
    davg, dstd = compute_descriptor_stats(batches, model)
    ref_davg, ref_dstd = direct_stats(systems, [3, 2], 3.5, 0.5, [12, 24], 2)
    np.testing.assert_allclose(davg, ref_davg, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dstd, ref_dstd, rtol=1e-10)
    assert davg[0, 0, 0] > 0 and np.all(davg[..., 1:] == 0)


@pytest.mark.parametrize(
    "descriptor",
    [
        {},  # every neighbour fits: each pair evaluated once for both ends
        {"sel": [2, 3]},  # fewer slots than neighbours: the nearest of each type, per centre
        {"exclude_types": [[0, 1]]},
    ],
    ids=["fits", "truncated", "excluded"],
)
def test_pair_statistics_equal_those_of_the_padded_lists(descriptor, monkeypatch):
    """The streamed pass (pairs, chunks across systems) gives the items of the per-batch
    padded lists; small periodic cells (atoms see their own images) and no cell included."""
    import mdtrain.neighbors.layout as layout  # the per-type lists are built through it

    padded_frames = []
    build = layout.build_nlist
    monkeypatch.setattr(layout, "build_nlist", lambda *a: padded_frames.append(1) or build(*a))
    systems = [
        make_system(3, True, 5, seed=1),
        make_system(2, False, 3, seed=2),
        make_system(1, True, 4, seed=4),  # a 4.3 Å cell, rcut 3.5: images of itself
        make_system(4, True, 2, seed=5, retype=2),
    ]
    cfg = small_config(descriptor)
    model = EnergyModel(cfg)
    expected = descriptor_stat_items(collect_stat_batches(systems, cfg, 3), model)
    plan = stat_batch_plan(systems, 3)
    padded_frames.clear()
    got, counts, energies = stream_stat_inputs(systems, model, plan, show_progress=False)
    assert (len(padded_frames) > 0) == ("sel" in descriptor)  # the truncated frames only
    assert got.keys() == expected.keys()
    for key, item in expected.items():
        assert got[key].number == item.number, key
        assert got[key].sum == pytest.approx(item.sum, rel=1e-12, abs=1e-13), key
        assert got[key].squared_sum == pytest.approx(item.squared_sum, rel=1e-12), key
    assert expected["r_0"].sum > 0 and expected["a_1"].squared_sum > 0
    frames = [min(3 * max(1, -(-32 // s.natoms)), s.nframes) for s in systems]
    assert len(energies) == len(counts) == sum(frames)
    np.testing.assert_array_equal(energies, np.concatenate([s.energy[:n] for s, n in
                                                            zip(systems, frames)]))  # fmt: skip


def test_pair_statistics_back_off_on_out_of_memory(monkeypatch):
    import mdtrain.model.descriptors.se_e2_a as stats
    from mdtrain.memory import simulated_oom

    systems = [make_system(3, True, 3, seed=1), make_system(2, False, 2, seed=2)]
    model = EnergyModel(small_config())
    plan = stat_batch_plan(systems, 10)
    expected = stream_stat_inputs(systems, model, plan, show_progress=False)[0]
    original = stats.smooth_weight
    sizes = []

    def small_memory(r, rcut_smth, rcut):
        sizes.append(r.shape[0])
        if r.shape[0] > 40:
            raise simulated_oom("CUDA out of memory. (test)")
        return original(r, rcut_smth, rcut)

    monkeypatch.setattr(stats, "smooth_weight", small_memory)
    sums = PairStatSums.of_model(model, chunk_pairs=1000)
    for system in systems:
        frames = system.frames(np.arange(system.nframes))
        for f in range(system.nframes):
            box = None if system.box is None else frames["box"][f]
            sums.add_frame(frames["coord"][f], box, system.atype)
    got = sums.items()
    assert max(sizes) > 40 and max(s for s in sizes if s <= 40) <= 40
    for key, item in expected.items():
        assert got[key].number == item.number
        assert got[key].sum == pytest.approx(item.sum, rel=1e-12)
        assert got[key].squared_sum == pytest.approx(item.squared_sum, rel=1e-12)


def test_many_frames_at_once_sum_as_frame_by_frame():
    """The collector's two visits (one frame at a time, or the frames of a whole window)
    evaluate the same pairs in the same pieces: the same sums, bit for bit."""
    from mdtrain.neighbors.stat import compute_neighbor_stat

    systems = [make_system(3, True, 5, seed=1), make_system(2, False, 3, seed=2),
               make_system(1, True, 4, seed=4)]  # fmt: skip
    cfg = small_config({"sel": "auto"})
    collectors = [StatCollector(systems, cfg, 2, torch.device("cpu")) for _ in range(2)]
    pieces: list[list[int]] = [[], []]
    for collector, seen in zip(collectors, pieces, strict=True):
        collector.sums.pending_pairs = 50  # evaluated every few frames
        flush = collector.sums.flush
        collector.sums.flush = lambda flush=flush, seen=seen, c=collector: (
            seen.append(c.sums._npending),
            flush(),
        )
    compute_neighbor_stat(systems, 3.5, 2, False, visit=collectors[0].visit, fingerprints=False)
    compute_neighbor_stat(systems, 3.5, 2, False, visit_frames=collectors[1].visit_frames,
                          fingerprints=False)  # fmt: skip
    assert collectors[0].seen == collectors[1].seen > 0
    assert len(pieces[0]) > 3 and pieces[0] == pieces[1]
    first, second = (c.sums.items() for c in collectors)
    assert first == second


@pytest.mark.parametrize("sel", [[40, 80], [2, 3]], ids=["fits", "truncated"])
def test_statistics_gathered_by_the_neighbour_search(sel, monkeypatch):
    """The neighbour statistics' search feeds the data statistics (no second search): the
    same items as the streamed pass; when the model's lists cannot hold every neighbour the
    gathered sums are refused and the frames are searched again, truncated."""
    import mdtrain.model.stats.pairs as stats
    from mdtrain.neighbors.stat import compute_neighbor_stat

    systems = [make_system(3, True, 5, seed=1), make_system(2, False, 3, seed=2),
               make_system(1, True, 4, seed=4)]  # fmt: skip
    cfg = small_config({"sel": "auto"})
    collector = StatCollector(systems, cfg, 3, torch.device("cpu"))
    found = compute_neighbor_stat(systems, 3.5, 2, False, visit=collector.visit, fingerprints=False)
    assert collector.items_for(EnergyModel(small_config()), stat_batch_plan(systems, 3)) is None
    collector.searched(found.max_nbor_size)  # what the search found: the lists that fit
    assert collector.seen == sum(min(3 * -(-32 // s.natoms), s.nframes) for s in systems)
    model = EnergyModel(small_config({"sel": sel}))
    plan = stat_batch_plan(systems, 3)
    expected = stream_stat_inputs(systems, model, plan, show_progress=False)[0]
    gathered = collector.items_for(model, plan)
    if sel == [2, 3]:
        assert gathered is None
        return
    for key, item in expected.items():
        assert gathered[key].number == item.number
        assert gathered[key].sum == pytest.approx(item.sum, rel=1e-12, abs=1e-13)
        assert gathered[key].squared_sum == pytest.approx(item.squared_sum, rel=1e-12)
    assert collector.items_for(model, stat_batch_plan(systems, 1)) is None  # other frames
    other = EnergyModel(small_config({"sel": sel, "rcut_smth": 1.0}))
    assert collector.items_for(other, plan) is None  # other switch: other sums
    searched = []  # with the gathered sums, the statistics search nothing again
    monkeypatch.setattr(stats, "frame_pairs", lambda *a: searched.append(1))
    compute_or_load_stats(model, systems, None, 3, presummed=collector)
    assert searched == []
    davg, dstd = model.descriptor.davg.clone(), model.descriptor.dstd.clone()
    monkeypatch.undo()
    compute_or_load_stats(model, systems, None, 3)
    torch.testing.assert_close(model.descriptor.davg, davg, rtol=1e-12, atol=0)
    torch.testing.assert_close(model.descriptor.dstd, dstd, rtol=1e-12, atol=0)


def test_absent_type_and_set_davg_zero():
    systems = [make_system(2, True, 2, seed=3)]
    cfg = small_config({"sel": [12, 24, 4], "set_davg_zero": True}, type_map=["O", "H", "C"])
    model = EnergyModel(cfg)
    davg, dstd = compute_descriptor_stats(collect_stat_batches(systems, cfg, 10), model)
    assert np.all(davg == 0)
    assert np.all(dstd[2] == 0.1)  # no C centre: default std
    ref_davg, ref_dstd = direct_stats(systems, [2], 3.5, 0.5, [12, 24, 4], 3)
    np.testing.assert_allclose(dstd[:2], ref_dstd[:2], rtol=1e-10)
    assert ref_davg[0, 0, 0] > 0  # the mean would not have been zero


def test_excluded_pairs_count_as_zeros():
    systems = [make_system(3, True, 1, seed=4)]
    plain = small_config()
    excl = small_config({"exclude_types": [[0, 1]]})
    d_plain = compute_descriptor_stats(collect_stat_batches(systems, plain, 1), EnergyModel(plain))
    d_excl = compute_descriptor_stats(collect_stat_batches(systems, excl, 1), EnergyModel(excl))
    assert d_excl[0][0, 0, 0] < d_plain[0][0, 0, 0]  # fewer non-zero entries for O centres


def test_nbatch_limits_the_sample():
    system = make_system(3, True, 10, seed=5)  # 9 atoms: 4 frames per batch, 3 batches
    cfg = small_config()
    assert [len(b["coord"]) for b in collect_stat_batches([system], cfg, 2)] == [4, 4]
    assert [len(b["coord"]) for b in collect_stat_batches([system], cfg, 10)] == [4, 4, 2]
    batch = collect_stat_batches([system], cfg, 1, batch_size=3)[0]
    np.testing.assert_array_equal(batch["coord"], system.coord[:3])
    assert batch["nlist"].shape == (3, 9, 36) and batch["shift"].shape == (3, 9, 36, 3)
    np.testing.assert_array_equal(batch["natoms_per_type"], [3, 6])


def test_energy_bias_least_squares():
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 20, size=(12, 3)).astype(float)
    true = np.array([-3.0, -0.5, -7.25])
    energy = counts @ true + rng.normal(scale=0.1, size=12)
    bias, std = compute_energy_bias(counts, energy)
    ref = np.linalg.lstsq(counts, energy, rcond=None)[0]
    np.testing.assert_allclose(bias, ref, rtol=1e-12)
    np.testing.assert_allclose(bias, true, atol=0.05)
    assert std.shape == (3,) and np.all(std == std[0])
    assert std[0] == pytest.approx(np.std(energy - counts @ ref), rel=1e-12)
    # one composition only: rank deficient, minimum-norm solution like lstsq
    bias, _ = compute_energy_bias(np.array([[2.0, 4.0]] * 3), np.array([-10.0] * 3))
    np.testing.assert_allclose(bias, np.linalg.pinv(np.array([[2.0, 4.0]])) @ [-10.0])


def test_stat_file_round_trip_and_stale_keys(tmp_path, caplog):
    path = str(tmp_path / "stat.h5")
    with h5py.File(path, "w") as f:
        f["other/keep_me"] = np.arange(3.0)
    systems = [make_system(3, True, 2, seed=6), make_system(2, True, 2, seed=7, path="b", retype=1)]
    first = EnergyModel(small_config())
    compute_or_load_stats(first, systems, path, nbatch=10)
    batches = collect_stat_batches(systems, small_config(), 10)
    davg, dstd = compute_descriptor_stats(batches, first)
    np.testing.assert_allclose(first.descriptor.davg.numpy(), davg)
    np.testing.assert_allclose(first.descriptor.dstd.numpy(), dstd)
    assert first.out_bias.numpy() == pytest.approx([-5.0, -1.0], abs=0.1)
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["other/keep_me"][()], np.arange(3.0))
        group = f[f"O H/{descriptor_stat_hash(first)}"]
        assert sorted(group) == ["a_0", "a_1", "r_0", "r_1"]
        assert group["r_0"].shape == (3,)
        assert f["O H/bias_atom_energy"].shape == (2, 1)
        assert f["O H/std_atom_energy"].shape == (2, 1)
    assert os.listdir(tmp_path) == ["stat.h5"]  # no temporary file left behind

    # the same data again: no warning
    with caplog.at_level("WARNING", logger="mdtrain"):
        compute_or_load_stats(EnergyModel(small_config()), systems, path, nbatch=10)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]

    # loaded, not recomputed: other systems would give other numbers; a warning says so
    other = [make_system(2, False, 1, seed=8, bias=(-9.0, 2.0))]
    second = EnergyModel(small_config())
    with caplog.at_level("WARNING", logger="mdtrain"):
        compute_or_load_stats(second, other, path, nbatch=10)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "other training data" in warnings[0] and path in warnings[0]
    for name, value in first.state_dict().items():
        if name in ("descriptor.davg", "descriptor.dstd", "out_bias", "out_std"):
            torch.testing.assert_close(second.state_dict()[name], value)

    # a changed rcut never reuses the stored descriptor numbers (the bias is kept)
    cfg = small_config({"rcut": 3.0})
    third = EnergyModel(cfg)
    assert descriptor_stat_hash(third) != descriptor_stat_hash(first)
    compute_or_load_stats(third, other, path, nbatch=10)
    ref_davg, _ = compute_descriptor_stats(collect_stat_batches(other, cfg, 10), third)
    np.testing.assert_allclose(third.descriptor.davg.numpy(), ref_davg)
    torch.testing.assert_close(third.out_bias, first.out_bias)
    with h5py.File(path, "r") as f:
        assert len([k for k in f["O H"] if not k.endswith("_energy")]) == 2
    # a changed sel, too
    fourth = EnergyModel(small_config({"sel": [12, 20]}))
    assert descriptor_stat_hash(fourth) not in (
        descriptor_stat_hash(first),
        descriptor_stat_hash(third),
    )


def test_no_stat_file_and_no_energies():
    system = make_system(2, True, 2, seed=9)
    system.energy = None
    model = EnergyModel(small_config())
    compute_or_load_stats(model, [system], None, nbatch=10)
    assert torch.all(model.out_bias == 0)
    assert model.descriptor.davg[0, 0, 0] > 0


def test_with_a_system_read_from_disk(tmp_path):
    """collect_stat_batches on a real deepmd/npy system (atoms unsorted on disk, H first)."""
    from mdtrain.data import open_system

    fake = make_system(3, True, 5, seed=12)
    order = np.argsort(-fake.atype, kind="stable")  # H atoms first on disk
    directory = tmp_path / "sys"
    (directory / "set.000").mkdir(parents=True)
    (directory / "type_map.raw").write_text("O\nH\n")
    (directory / "type.raw").write_text("\n".join(str(t) for t in fake.atype[order]) + "\n")
    np.save(directory / "set.000/coord.npy", fake.coord[:, order].reshape(5, -1))
    np.save(directory / "set.000/box.npy", fake.box.reshape(5, 9))
    np.save(directory / "set.000/energy.npy", fake.energy)
    system = open_system(str(directory), ["O", "H"])
    cfg = small_config()
    from_disk = collect_stat_batches([system], cfg, 10)
    direct = collect_stat_batches([fake], cfg, 10)
    model = EnergyModel(cfg)
    for a, b in zip(
        compute_descriptor_stats(from_disk, model),
        compute_descriptor_stats(direct, model),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([b["energy"] for b in from_disk]), fake.energy)
    compute_or_load_stats(model, [system], None, nbatch=10)
    assert model.descriptor.davg[0, 0, 0] > 0
