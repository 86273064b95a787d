"""Batch sizes, system probabilities and the restorable, rank-sharded training sampler."""

import io
import json

import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.train.sampler import TrainingSampler, batch_sizes, batches_per_epoch, system_probs


def test_batch_size_rules():
    natoms = [3, 32, 33, 192]
    assert batch_sizes("auto", natoms) == [11, 1, 1, 1]
    assert batch_sizes("auto:64", natoms) == [22, 2, 2, 1]
    assert batch_sizes("max:64", natoms) == [21, 2, 1, 1]
    assert batch_sizes(4, natoms) == [4, 4, 4, 4]
    assert batch_sizes([1, 2, 3, 4], natoms) == [1, 2, 3, 4]
    assert batch_sizes("mixed:4", natoms) == [4, 4, 4, 4]  # N frames whatever the size
    assert batch_sizes("mixed:4", natoms, nframes=[9, 3, 1, 4]) == [4, 3, 1, 4]  # no copies


def test_compositions_of_one_system_share_its_entries():
    """A mixed-type system opened as several compositions counts as one system for the
    per-system lists and the probability rules; its probability is split by batches."""
    natoms, sources = [3, 12, 12, 5], ["a", "m", "m", "b"]
    assert batch_sizes([1, 2, 3], natoms, sources=sources) == [1, 2, 2, 3]
    assert batch_sizes("auto", natoms, sources=sources) == [11, 3, 3, 7]
    with pytest.raises(MDTrainError, match="4 values given for 3 systems"):
        batch_sizes([1, 2, 3, 4], natoms, sources=sources)
    nb = [2, 1, 3, 4]
    uniform = system_probs(nb, auto_prob="prob_uniform", sources=sources)
    np.testing.assert_allclose(uniform, [1 / 3, 1 / 12, 3 / 12, 1 / 3])
    np.testing.assert_allclose(system_probs(nb, sources=sources), system_probs(nb))
    given = system_probs(nb, sys_probs=[0.5, 0.2, 0.3], sources=sources)
    np.testing.assert_allclose(given, [0.5, 0.05, 0.15, 0.3])
    blocks = system_probs(nb, auto_prob="prob_sys_size;0:1:1;1:3:3", sources=sources)
    np.testing.assert_allclose(blocks, [0.25, 0.75 * 1 / 8, 0.75 * 3 / 8, 0.75 * 4 / 8])
    # every system its own source: the probabilities are the plain ones, bit for bit
    assert system_probs(nb, sources=list("abcd")).tolist() == system_probs(nb).tolist()


@pytest.mark.parametrize(
    "spec", ["foo", "auto:0", "auto:x", "mixed", "mixed:0", 0, [1, 2], [1, 0, 1], True]
)
def test_batch_size_errors_name_the_path(spec):
    with pytest.raises(MDTrainError, match=r"training\.training_data\.batch_size"):
        batch_sizes(spec, [3, 4, 5])


def test_probability_rules():
    nb = [1, 3, 2, 2]
    np.testing.assert_allclose(system_probs(nb, auto_prob="prob_uniform"), [0.25] * 4)
    np.testing.assert_allclose(system_probs(nb), [1 / 8, 3 / 8, 2 / 8, 2 / 8])
    np.testing.assert_allclose(
        system_probs(nb, auto_prob="prob_sys_size;0:2:0.25;2:4:0.75"),
        [0.25 / 4, 0.75 / 4, 0.375, 0.375],
    )
    # weights are normalised; uncovered systems get zero
    np.testing.assert_allclose(system_probs(nb, auto_prob="prob_sys_size;1:3:2"), [0, 0.6, 0.4, 0])
    # negative entries share what is left by batch count; sys_probs wins over auto_prob
    np.testing.assert_allclose(
        system_probs([5, 1, 3], sys_probs=[0.5, -1, -1], auto_prob="prob_uniform"),
        [0.5, 0.125, 0.375],
    )
    np.testing.assert_allclose(system_probs([1, 1], sys_probs=[0.3, 0.7]), [0.3, 0.7])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sys_probs=[0.3, 0.3, 0.3, 0.3]),
        dict(sys_probs=[0.5, 0.2, 0.2, 0.2]),
        dict(sys_probs=[0.5, 0.5]),
        dict(auto_prob="prob_sys_size;0:3:1;2:4:1"),
        dict(auto_prob="prob_sys_size;0:5:1"),
        dict(auto_prob="prob_sys_size;0:2"),
        dict(auto_prob="prob_sys_size;0:2:0"),
        dict(auto_prob="prob_whatever"),
    ],
)
def test_probability_errors(kwargs):
    with pytest.raises(MDTrainError, match="training_data"):
        system_probs([1, 3, 2, 2], **kwargs)


def test_batches_per_epoch_uses_global_batch():
    assert batches_per_epoch([10, 7, 1], [2, 3, 1]) == [5, 3, 1]
    assert batches_per_epoch([10, 7, 1], [2, 3, 1], world_size=2) == [3, 2, 1]


NFRAMES = [10, 7, 25]
PROBS = [0.3, 0.2, 0.5]


def draw(sampler, steps):
    return [(s, f.tolist()) for s, f in (sampler.next_batch() for _ in range(steps))]


def test_deterministic_and_seed_dependent():
    a = draw(TrainingSampler(NFRAMES, [2, 3, 4], PROBS, seed=5), 200)
    b = draw(TrainingSampler(NFRAMES, [2, 3, 4], PROBS, seed=5), 200)
    c = draw(TrainingSampler(NFRAMES, [2, 3, 4], PROBS, seed=6), 200)
    assert a == b
    assert a != c


def test_batches_are_full_single_system_and_each_epoch_is_a_permutation():
    sizes = [2, 3, 4]
    steps = draw(TrainingSampler(NFRAMES, sizes, PROBS, seed=1), 600)
    streams = {s: [] for s in range(3)}
    for s, frames in steps:
        assert len(frames) == sizes[s]
        assert all(0 <= f < NFRAMES[s] for f in frames)
        streams[s].extend(frames)
    for s, stream in streams.items():
        n = NFRAMES[s]
        epochs = [stream[i : i + n] for i in range(0, len(stream) - n + 1, n)]
        assert len(epochs) >= 5
        for epoch in epochs:
            assert sorted(epoch) == list(range(n))
        assert epochs[0] != epochs[1]  # reshuffled every epoch


@pytest.mark.parametrize("probs", [[1.0], [0.2, 0.0, 0.5, 0.3], [1 / 3] * 3, [0.0, 1.0]])
def test_system_draws_are_generator_choice(probs):
    """The systems drawn are, one by one, what numpy's ``Generator.choice(n, p=probs)``
    draws from the same random stream (checkpoints of earlier runs continue the same
    batches), and the stream is left where ``choice`` leaves it."""
    sampler = TrainingSampler([4] * len(probs), [1] * len(probs), probs, seed=11)
    reference = np.random.Generator(np.random.PCG64(np.random.SeedSequence([11, 0])))
    for _ in range(3000):
        expected = int(reference.choice(len(probs), p=sampler.probs))
        assert sampler.next_batch()[0] == expected
    assert sampler._rng.bit_generator.state == reference.bit_generator.state


def test_system_frequencies_follow_probabilities():
    steps = draw(TrainingSampler(NFRAMES, [1, 1, 1], PROBS, seed=0), 20000)
    freq = np.bincount([s for s, _ in steps], minlength=3) / 20000
    np.testing.assert_allclose(freq, PROBS, atol=0.015)


def test_zero_probability_system_is_never_drawn():
    steps = draw(TrainingSampler(NFRAMES, [1, 1, 1], [0.5, 0.0, 0.5], seed=0), 500)
    assert 1 not in {s for s, _ in steps}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_together_consume_what_one_rank_with_the_global_batch_would(world_size):
    b = [2, 1, 3]
    single = draw(TrainingSampler(NFRAMES, [world_size * x for x in b], PROBS, seed=9), 300)
    ranks = [
        draw(TrainingSampler(NFRAMES, b, PROBS, seed=9, rank=r, world_size=world_size), 300)
        for r in range(world_size)
    ]
    for step, (system, frames) in enumerate(single):
        assert all(rank[step][0] == system for rank in ranks)  # same system on every rank
        assert sum((rank[step][1] for rank in ranks), []) == frames
        for rank in ranks:
            assert len(rank[step][1]) == b[system]


def roundtrip_json(state):
    return json.loads(json.dumps(state))


def roundtrip_torch(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("roundtrip", [roundtrip_json, roundtrip_torch])
def test_state_round_trip_continues_exactly(roundtrip):
    original = TrainingSampler(NFRAMES, [2, 3, 4], PROBS, seed=4)
    draw(original, 37)
    state = roundtrip(original.state_dict())
    expected = draw(original, 80)
    resumed = TrainingSampler(NFRAMES, [2, 3, 4], PROBS, seed=123)  # stored seed wins
    resumed.load_state_dict(state)
    assert draw(resumed, 80) == expected
    assert resumed.step == 37 + 80


def test_restart_on_a_different_number_of_ranks_continues_the_global_stream():
    one = TrainingSampler(NFRAMES, [4, 2, 6], PROBS, seed=2)
    draw(one, 50)
    state = roundtrip_json(one.state_dict())
    expected = draw(one, 60)
    two = [
        TrainingSampler(NFRAMES, [2, 1, 3], PROBS, seed=2, rank=r, world_size=2) for r in range(2)
    ]
    for sampler in two:
        sampler.load_state_dict(state)
    got0, got1 = draw(two[0], 60), draw(two[1], 60)
    assert [(s, f0 + f1) for (s, f0), (_, f1) in zip(got0, got1, strict=True)] == expected


def test_state_refuses_changed_data():
    state = TrainingSampler(NFRAMES, [1, 1, 1], PROBS, seed=0).state_dict()
    other = TrainingSampler([10, 7, 26], [1, 1, 1], PROBS, seed=0)
    with pytest.raises(MDTrainError, match="systems changed"):
        other.load_state_dict(state)
