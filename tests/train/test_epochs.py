"""numb_epoch in steps, as DeePMD-kit 3.2's PyTorch trainer counts them, against exact
rational arithmetic."""

import math
from fractions import Fraction

import pytest

from mdtrain.errors import MDTrainError
from mdtrain.train.epochs import steps_for_epochs
from mdtrain.train.sampler import TrainingSampler, batches_per_epoch


def exact_steps(epochs, nbatch, probs):
    """ceil(epochs * ceil(max_i nbatch_i / p_i)) in exact arithmetic (probs as Fractions)."""
    total = max(Fraction(n) / p for n, p in zip(nbatch, probs, strict=True) if p > 0)
    return math.ceil(Fraction(epochs) * math.ceil(total))


@pytest.mark.parametrize("nbatch", [[4, 4], [3, 5, 7], [10, 1, 1, 2], [1]])
@pytest.mark.parametrize("epochs", [1, 2.5, 0.3, 7])
def test_size_proportional_probabilities(nbatch, epochs):
    # p_i = n_i / sum: every system takes sum(n) steps to be visited n_i times on average
    probs = [Fraction(n, sum(nbatch)) for n in nbatch]
    assert steps_for_epochs(epochs, nbatch) == exact_steps(epochs, nbatch, probs)
    assert steps_for_epochs(1, nbatch) == sum(nbatch)


def test_uniform_and_explicit_probabilities():
    nbatch = [2, 6, 4]
    uniform = [Fraction(1, 3)] * 3
    assert steps_for_epochs(2, nbatch, auto_prob="prob_uniform") == exact_steps(2, nbatch, uniform)
    assert steps_for_epochs(1, nbatch, auto_prob="prob_uniform") == 18  # 6 / (1/3)
    # sys_probs: 0.5 for the first, the rest shared by batch count (6:4)
    given = [Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)]
    assert steps_for_epochs(1, nbatch, sys_probs=[0.5, -1, -1]) == exact_steps(1, nbatch, given)
    # blocks: systems [0,1) weight 1, [1,3) weight 3, split by batch count
    blocks = [Fraction(1, 4), Fraction(3, 4) * Fraction(6, 10), Fraction(3, 4) * Fraction(4, 10)]
    got = steps_for_epochs(1.5, nbatch, auto_prob="prob_sys_size;0:1:1;1:3:3")
    assert got == exact_steps(1.5, nbatch, blocks)
    # a system never drawn does not count
    assert steps_for_epochs(1, [5, 100], sys_probs=[1.0, 0.0]) == 5


def test_batches_per_rank():
    # 2 ranks, 10 frames, batch 2: ceil(10 / 4) = 3 batches per pass on each rank
    assert batches_per_epoch([10, 7], [2, 1], world_size=2) == [3, 4]
    sampler = TrainingSampler([10, 7], [2, 1], [0.5, 0.5], seed=1, rank=0, world_size=2)
    assert batches_per_epoch(sampler.nframes, sampler.batch_sizes, sampler.world_size) == [3, 4]


def test_bad_epochs():
    with pytest.raises(MDTrainError, match="numb_epoch"):
        steps_for_epochs(0, [1, 2])
