"""Micro-batch controller: same gradient as the full batch, the split per size and its retry
clock, fixed micro-batches, growth, restart state, and the votes of a rank (scripted peers)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.train.batch_controller import (
    MicroBatchController,
    frame_weights,
    merge_states,
    split_frames,
)
from tests.helpers.micro_batch import (
    TinyEnergyModel,
    accumulating_attempt,
    fake_attempt,
    grads,
    oom,
    tiny_batch,
    tiny_loss,
)


# ------------------------------------------------------------------ splitting
@pytest.mark.parametrize("nframes", [1, 2, 3, 7, 16, 17])
@pytest.mark.parametrize("nsplit", [1, 2, 3, 4, 8, 40])
def test_split_is_balanced_contiguous_and_capped(nframes, nsplit):
    slices = split_frames(nframes, nsplit)
    assert len(slices) == min(nsplit, nframes)
    assert slices[0].start == 0 and slices[-1].stop == nframes
    assert all(a.stop == b.start for a, b in zip(slices, slices[1:], strict=False))
    sizes = [s.stop - s.start for s in slices]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert sum(frame_weights(slices, nframes)) == pytest.approx(1.0, abs=1e-15)


# ------------------------------------------------------------------ gradient equivalence
def _reference(model, batch):
    tiny_loss(model, *batch).backward()
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    return ref


def _assert_grads(model, reference):
    for got, ref in zip(grads(model), reference, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_accumulated_gradient_equals_full_batch_gradient():
    model, batch = TinyEnergyModel(), tiny_batch()
    reference = _reference(model, batch)
    for nsplit in range(2, 8):
        model.zero_grad(set_to_none=True)
        accumulating_attempt(model, batch)(split_frames(7, nsplit))
        _assert_grads(model, reference)


def test_run_step_discards_partial_gradients_of_failed_attempts():
    model, batch = TinyEnergyModel(), tiny_batch(nframes=8)
    reference = _reference(model, batch)
    ctrl = MicroBatchController()
    attempt = accumulating_attempt(model, batch, fits=lambda n: n <= 2)
    used = ctrl.run_step(attempt, 8, 5, "sys", zero_grad=lambda: model.zero_grad(set_to_none=True))
    assert used == 4 and ctrl.micro_batches(8, 5) == 4
    _assert_grads(model, reference)


@pytest.mark.parametrize("fixed", [2, 3, 7])
def test_fixed_micro_batches_give_the_whole_batch_gradient(fixed):
    """micro_batches: every batch starts split (3 → 3+2+2 frames, unequal weights)."""
    model, batch = TinyEnergyModel(), tiny_batch(nframes=7)
    reference = _reference(model, batch)
    ctrl = MicroBatchController(micro_batches=fixed)
    attempt = accumulating_attempt(model, batch)
    used = ctrl.run_step(attempt, 7, 5, "sys", zero_grad=lambda: model.zero_grad(set_to_none=True))
    assert used == fixed and ctrl.oom_count == 0
    _assert_grads(model, reference)


# ------------------------------------------------------------------ the split of one size
def test_on_oom_doubles_and_raises_at_one_frame_per_micro_batch():
    ctrl = MicroBatchController()
    assert [ctrl.on_oom(6, 192, "water/a", n) for n in (1, 2, 4)] == [2, 4, 8]
    assert ctrl.split(6, 192) == split_frames(6, 6)
    assert ctrl.micro_batches(1, 192) == 1  # a smaller size is not split
    with pytest.raises(MDTrainError, match=r"system water/a: a single frame of 192 atoms"):
        ctrl.on_oom(6, 192, "water/a", 8)


def test_run_step_raises_the_too_large_frame_error_after_trying_every_split():
    ctrl = MicroBatchController()
    tried = []
    with pytest.raises(MDTrainError, match="a single frame of 300 atoms does not fit"):
        ctrl.run_step(fake_attempt(0, 300, tried), 5, 300, "big")
    assert tried == [1, 2, 4, 5]


def test_non_oom_errors_propagate_without_retry():
    ctrl = MicroBatchController()
    calls = []

    def attempt(slices):
        calls.append(1)
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        ctrl.run_step(attempt, 4, 3, "s")
    assert calls == [1] and ctrl.sizes == {} and ctrl.oom_count == 0


def _drive(ctrl, steps, fits_frames, nframes=16, natoms=10):
    """``steps`` steps of one size where a micro-batch fits only up to ``fits_frames`` frames;
    the split after each step."""
    history = []
    for _ in range(steps):
        ctrl.run_step(fake_attempt(fits_frames * natoms, natoms), nframes, natoms, "s")
        history.append(ctrl.micro_batches(nframes, natoms))
    return history


def test_retry_halves_after_interval_and_backs_off_when_it_fails(caplog):
    ctrl = MicroBatchController(retry_interval=5)
    with caplog.at_level(logging.INFO, logger="mdtrain.train.batch"):
        history = _drive(ctrl, 40, fits_frames=4)
    # 16 frames, 4 fit: 4 micro-batches are needed; halvings to 2 fail, the wait doubles
    assert [k + 1 for k, n in enumerate(history) if n == 2] == [5, 15, 35]
    assert set(history) == {2, 4}
    assert len([r for r in caplog.records if "trying" in r.getMessage()]) == 3
    assert ctrl.sizes[160].wait == 40 and ctrl.sizes[160].ooms == 2 + 3
    assert len(caplog.records) < 15  # every change is logged once, never every step


def test_retry_returns_to_one_when_memory_allows():
    ctrl = MicroBatchController(retry_interval=3)
    _drive(ctrl, 1, fits_frames=4)
    assert ctrl.micro_batches(16, 10) == 4
    assert _drive(ctrl, 12, fits_frames=16) == [4, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert ctrl.sizes[160].wait == 3


def test_each_size_keeps_its_own_split_and_clock():
    """A large size is split while a small one runs whole; the large one's retry clock counts
    its own successes only."""
    ctrl = MicroBatchController(retry_interval=5)
    large, small = [], []
    ctrl.run_step(fake_attempt(40, 10, large), 16, 10, "large")  # 4 frames fit: 1, 2, 4
    for _ in range(20):
        ctrl.run_step(fake_attempt(40, 10, small), 2, 10, "small")
    assert large == [1, 2, 4] and small == [1] * 20
    assert ctrl.micro_batches(16, 10) == 4  # 21 steps, but 1 success of its own
    for _ in range(4):
        ctrl.run_step(fake_attempt(40, 10, large), 16, 10, "large")
    assert ctrl.micro_batches(16, 10) == 2  # the 5th success of the large size: a trial
    assert ctrl.micro_batches(2, 10) == 1 and 20 not in ctrl.sizes


def test_a_rare_large_system_pays_at_most_two_ooms_and_small_ones_run_whole():
    """One system in 1,000 needs two micro-batches; 100k steps (the global split of before
    paid 84 OOMs here and split every small system after each of them)."""
    fits = 1500  # atoms per micro-batch
    systems = [(64, 4), (96, 3), (128, 2), (192, 2), (1000, 2)]  # (atoms, frames): auto:256
    probs = np.array([0.25, 0.25, 0.25, 0.249, 0.001])
    draws = np.random.default_rng(3).choice(len(systems), size=100_000, p=probs / probs.sum())
    ctrl = MicroBatchController()
    calls: dict[int, list[int]] = {k: [] for k in range(len(systems))}
    for k in draws:
        natoms, nframes = systems[k]
        ctrl.run_step(fake_attempt(fits, natoms, calls[k]), nframes, natoms, f"sys{k}")
    large = systems[-1][0] * systems[-1][1]
    assert len(calls[4]) > 50 and set(ctrl.sizes) == {large}
    assert 1 <= ctrl.sizes[large].ooms <= 2 and ctrl.oom_count == ctrl.sizes[large].ooms
    assert all(set(calls[k]) == {1} for k in range(4))  # small systems: whole, every time
    assert calls[4][0] == 1 and set(calls[4][2:]) == {2}  # the large one: split after its OOM


def test_an_unseen_larger_size_starts_from_a_split_smaller_one():
    ctrl = MicroBatchController()
    tried = []
    ctrl.run_step(fake_attempt(1000, 100, tried), 20, 100, "big")  # 2000 atoms need 2
    assert tried == [1, 2]
    for natoms, nframes, first in ((101, 20, 3), (100, 40, 4), (99, 20, 1), (10, 20, 1)):
        tried = []
        ctrl.run_step(fake_attempt(1000, natoms, tried), nframes, natoms, "other")
        # slightly larger: micro-batches no larger than the known split's (3, not 4);
        # slightly smaller: whole first (one OOM); much smaller: whole
        assert tried[0] == first, (natoms, nframes, tried)
    assert ctrl.oom_count == 2  # the first size's, and 99×20's


def test_fixed_micro_batches_is_a_floor():
    ctrl = MicroBatchController(retry_interval=2, micro_batches=3)
    tried = []
    for _ in range(6):  # memory for everything: never fewer than 3
        ctrl.run_step(fake_attempt(10**6, 10, tried), 12, 10, "s")
    assert tried == [3] * 6 and ctrl.sizes == {}
    tried = []
    for _ in range(6):  # 2 frames fit: split further, retries come back down to 3 only
        ctrl.run_step(fake_attempt(20, 10, tried), 12, 10, "s")
    assert tried == [3, 6, 6, 3, 6, 6, 6, 6]  # a trial after 2 successes, then after 4
    assert ctrl.micro_batches(12, 10) == 3 and ctrl.sizes[120].wait == 4
    with pytest.raises(ValueError):
        MicroBatchController(micro_batches=0)


# ------------------------------------------------------------------ growth (agreed)
def test_grow_scales_batches_and_reverts_on_oom():
    ctrl = MicroBatchController(retry_interval=2, grow=True, max_scale=8)
    scales = []
    for _ in range(8):
        ctrl.on_step()
        scales.append(ctrl.suggest_growth())
    assert scales == [1, 2, 2, 4, 4, 8, 8, 8]
    tried = []  # a step at scale 8 runs out of memory: retried in two halves, then scale 4
    ctrl.run_step(fake_attempt(8 * 12, 12, tried), 16, 12, "s")
    assert tried == [1, 2] and ctrl.batch_scale == 4 and ctrl.scale_cap == 4
    for _ in range(10):
        ctrl.on_step()
    assert ctrl.batch_scale == 4  # never grows again to a size that failed


def test_a_size_trial_at_a_grown_scale_does_not_shrink_it():
    ctrl = MicroBatchController(retry_interval=2, grow=True, max_scale=8)
    attempt = fake_attempt(10, 10)  # one 10-atom frame per micro-batch fits
    ctrl.run_step(attempt, 2, 10, "big")  # OOM at scale 1: 2 micro-batches
    ctrl.run_step(attempt, 2, 10, "big")  # 2 clean steps: scale 2; 2 successes: trial of 1
    assert ctrl.batch_scale == 2 and ctrl.micro_batches(2, 10) == 1
    ctrl.run_step(attempt, 2, 10, "big")  # the trial fails: that size's business only
    assert ctrl.batch_scale == 2 and ctrl.micro_batches(2, 10) == 2 and ctrl.sizes[20].wait == 4
    ctrl.run_step(fake_attempt(10, 5), 3, 5, "grown")  # a batch that ran whole: growth's fault
    assert ctrl.batch_scale == 1 and ctrl.scale_cap == 1


def test_growth_is_off_unless_enabled_and_waits_after_an_oom():
    ctrl = MicroBatchController(retry_interval=1, max_scale=8)
    for _ in range(5):
        ctrl.on_step()
    assert ctrl.batch_scale == 1
    ctrl = MicroBatchController(retry_interval=3, grow=True, max_scale=8)
    ctrl.run_step(fake_attempt(4, 1), 8, 1, "s")  # OOM: the clock starts again
    ctrl.on_step()
    assert ctrl.batch_scale == 1
    ctrl.on_step()
    assert ctrl.batch_scale == 2


# ------------------------------------------------------------------ restart state
def test_the_split_table_survives_restart(tmp_path):
    ctrl = MicroBatchController(retry_interval=5)
    _drive(ctrl, 3, fits_frames=2)
    _drive(ctrl, 2, fits_frames=2, nframes=4, natoms=7)
    torch.save(ctrl.state_dict(), tmp_path / "state.pt")
    clone = MicroBatchController(retry_interval=5)
    clone.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert clone.state_dict() == ctrl.state_dict()
    assert clone.split(16, 10) == split_frames(16, 8) and clone.micro_batches(4, 7) == 2
    assert clone.micro_batches(2, 7) == 1


def test_an_old_global_state_loads_as_the_start_of_every_size():
    old = {
        "nsplit": 4, "best_nsplit": 4, "batch_scale": 2, "scale_cap": 4, "successes": 3,
        "wait": 3, "trial": False, "oom_count": 2,
    }  # fmt: skip
    ctrl = MicroBatchController(retry_interval=3)
    ctrl.load_state_dict(old)
    assert ctrl.batch_scale == 2 and ctrl.scale_cap == 4 and ctrl.oom_count == 2
    assert ctrl.micro_batches(16, 10) == 4 and ctrl.micro_batches(1, 3) == 4
    assert _drive(ctrl, 4, fits_frames=16) == [4, 4, 2, 2]  # this size's own clock
    assert ctrl.micro_batches(8, 10) == 4  # other sizes still start from the old split
    state = ctrl.state_dict()
    assert state["version"] == 2 and state["default"]["nsplit"] == 4
    again = MicroBatchController(retry_interval=3)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_merged_state_keeps_every_rank_size_with_the_largest_split():
    ranks = [MicroBatchController(), MicroBatchController()]
    ranks[0].on_oom(4, 10, "a", 1)  # size 40: 2
    ranks[1].on_oom(4, 10, "a", 2)  # size 40: 4
    ranks[1].on_oom(2, 30, "b", 1)  # size 60: 2
    merged = MicroBatchController()
    merged.load_state_dict(merge_states([r.state_dict() for r in ranks]))
    assert merged.micro_batches(4, 10) == 4 and merged.micro_batches(2, 30) == 2


# ------------------------------------------------------------------ votes (scripted peers)
class Peers:
    """``any_rank`` of a rank whose peers vote from a script; counts the calls."""

    def __init__(self, votes: list[bool]) -> None:
        self.votes, self.calls = list(votes), 0

    def __call__(self, flag: bool) -> bool:
        self.calls += 1
        return flag or (self.votes.pop(0) if self.votes else False)


def test_a_rank_that_succeeded_keeps_its_gradients_while_a_peer_retries():
    model, batch = TinyEnergyModel(), tiny_batch(nframes=6)
    reference = _reference(model, batch)
    ctrl = MicroBatchController()
    tried = []
    attempt = accumulating_attempt(model, batch)
    peers = Peers([True, False, True, False, False])  # the peer fails twice, then succeeds

    def counted(slices):
        tried.append(len(slices))
        return attempt(slices)

    zero = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    ctrl.run_step(counted, 6, 5, "s", peers, zero_grad=zero)
    assert tried == [1]  # not redone while the peer retried
    assert peers.calls == 2 + 2 + 1 and ctrl.oom_count == 2 and ctrl.sizes == {}
    _assert_grads(model, reference)


def test_a_grown_scale_takes_one_more_vote_per_failed_attempt():
    ctrl = MicroBatchController(retry_interval=1, grow=True, max_scale=4)
    ctrl.on_step()
    assert ctrl.batch_scale == 2
    peers = Peers([True, False, True])  # peer: OOM, not stuck, growth's fault
    ctrl.run_step(fake_attempt(100, 1), 4, 1, "s", peers)
    assert peers.calls == 3 + 1 and ctrl.batch_scale == 1 and ctrl.scale_cap == 1


def test_the_peer_stuck_vote_fails_every_rank():
    ctrl = MicroBatchController()
    with pytest.raises(MDTrainError, match="another rank with a single frame"):
        ctrl.run_step(fake_attempt(100, 1), 4, 1, "s", Peers([True, True]))


def test_run_step_oom_in_the_attempt_before_any_backward():
    """An OOM raised before the first micro-batch ran (e.g. reading frames) is retried too."""
    ctrl = MicroBatchController()
    first = [True]

    def attempt(slices):
        if first.pop() if first else False:
            raise oom()
        return len(slices)

    assert ctrl.run_step(attempt, 4, 3, "s") == 2
