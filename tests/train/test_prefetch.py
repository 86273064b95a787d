"""Neighbour lists built ahead in a background thread (`mdtrain.train.prefetch`): the same
lists, the same batches in the same order, exact restarts, bounded memory, no thread left."""

from __future__ import annotations

import gc
import json
import threading
import time

import numpy as np
import pytest

from mdtrain.batching import NeighborListCache, make_batch
from mdtrain.cli import main
from mdtrain.data import open_system
from mdtrain.neighbors.layout import MIXED, PER_TYPE
from mdtrain.train import prefetch as prefetch_module
from mdtrain.train.prefetch import ListPrefetcher, coming
from mdtrain.train.sampler import TrainingSampler
from tests.helpers.datagen import water_labeled, write_npy_system
from tests.helpers.training import load_params, make_project, max_param_diff

RCUT, SEL = 4.0, [12, 24]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefetch") / "sys"
    write_npy_system(path, **water_labeled(10, 8, 6.0, 5))
    return open_system(str(path), ["O", "H"])


def _wait(prefetcher: ListPrefetcher, count: int) -> None:
    deadline = time.monotonic() + 30
    while prefetcher.searched < count:
        assert time.monotonic() < deadline, "the prefetch thread built nothing"
        time.sleep(0.005)


_BEFORE: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _threads_before():
    """Threads of other tests in this worker (a trainer stepped by hand ends its thread when
    it is freed, which the garbage collector may not have done yet) are not this test's."""
    _BEFORE.clear()
    _BEFORE.update(threading.enumerate())


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mdtrain-nlist" and t not in _BEFORE]


def test_peek_gives_the_next_draws_and_leaves_the_sampler_as_it_was():
    sampler = TrainingSampler([5, 3], [2, 1], [0.5, 0.5], seed=3)
    for _ in range(4):
        sampler.next_batch()
    before = sampler.state_dict()
    peeked = sampler.peek(9, scale=2)  # across several epochs of both systems
    assert sampler.state_dict() == before
    for index, frames in peeked:
        got = sampler.next_batch(2)
        assert got[0] == index and np.array_equal(got[1], frames)


def test_coming_lists_this_step_then_each_step_ahead_for_every_sampler(system):
    samplers = [TrainingSampler([10], [2], [1.0], seed=s) for s in (1, 2)]  # per-member draws
    current = [s.next_batch() for s in samplers]
    ahead = [s.peek(2) for s in samplers]
    got = coming([system], samplers, current, 2)
    expected = [current[0], current[1], ahead[0][0], ahead[1][0], ahead[0][1], ahead[1][1]]
    assert [f.tolist() for _, f in got] == [f.tolist() for _, f in expected]
    assert all(s is system for s, _ in got)


@pytest.mark.parametrize("layout", [PER_TYPE, MIXED], ids=lambda x: x.name)
def test_prefetched_lists_equal_the_lists_built_in_the_step(system, layout):
    cache = NeighborListCache()
    prefetcher = ListPrefetcher(cache, (RCUT, SEL, layout))
    cache.ahead = prefetcher
    try:
        prefetcher.plan([(system, np.array([3, 7])), (system, np.array([1]))])
        _wait(prefetcher, 3)
        batch = make_batch(system, [3, 7, 1], RCUT, SEL, cache=cache, layout=layout)
        plain = make_batch(system, [3, 7, 1], RCUT, SEL, layout=layout)
    finally:
        prefetcher.close()
    assert prefetcher.used == 3 and cache.misses == 3 and len(cache) == 3
    assert np.array_equal(batch.nlist.numpy(), plain.nlist.numpy())
    assert np.array_equal(batch.shift.numpy(), plain.shift.numpy())


def test_frames_not_planned_or_already_kept_are_built_in_the_step(system):
    cache = NeighborListCache()
    make_batch(system, [0], RCUT, SEL, cache=cache)  # kept: nothing to build ahead
    prefetcher = ListPrefetcher(cache, (RCUT, SEL, PER_TYPE))
    cache.ahead = prefetcher
    try:
        prefetcher.plan([(system, np.array([0]))])
        assert prefetcher.pending() == 0
        batch = make_batch(system, [5], RCUT, SEL, cache=cache)  # a guess that missed
    finally:
        prefetcher.close()
    plain = make_batch(system, [5], RCUT, SEL)
    assert prefetcher.used == 0
    assert np.array_equal(batch.nlist.numpy(), plain.nlist.numpy())


def test_memory_is_bounded_by_the_last_plan(system):
    cache = NeighborListCache()
    prefetcher = ListPrefetcher(cache, (RCUT, SEL, PER_TYPE))
    try:
        prefetcher.plan([(system, np.array([f])) for f in range(6)])
        _wait(prefetcher, 2)
        prefetcher.plan([(system, np.array([8]))])  # the others are no longer wanted
        assert prefetcher.pending() <= 2  # frame 8, and at most one being built
        _wait(prefetcher, prefetcher.searched + 1)
        assert prefetcher.pending() == 1
    finally:
        prefetcher.close()
    assert prefetcher.pending() == 0 and not _threads()


def test_a_search_that_fails_in_the_thread_is_done_again_in_the_step(system):
    class FailsInThread:
        name = "per_type"

        def build(self, *args):
            if threading.current_thread().name == "mdtrain-nlist":
                raise ValueError("neighbour search failed")
            return PER_TYPE.build(*args)

    cache = NeighborListCache()
    prefetcher = ListPrefetcher(cache, (RCUT, SEL, FailsInThread()))
    cache.ahead = prefetcher
    try:
        prefetcher.plan([(system, np.array([2]))])
        _wait(prefetcher, 1)  # tried, and failed
        batch = make_batch(system, [2], RCUT, SEL, cache=cache, layout=FailsInThread())
    finally:
        prefetcher.close()
    assert prefetcher.used == 0 and prefetcher.built == 0
    assert np.array_equal(batch.nlist.numpy(), make_batch(system, [2], RCUT, SEL).nlist.numpy())


def _train(inp, out, *extra) -> int:
    return main(["train", str(inp), "-o", str(out), *extra])


def _with(inp, **training):
    config = json.loads(inp.read_text())
    config["training"].update(training)
    path = inp.parent / f"input-{'-'.join(f'{k}{v}' for k, v in training.items())}.json"
    path.write_text(json.dumps(config))
    return path


def test_a_run_with_prefetch_equals_one_without_and_restarts_exactly(tmp_path, monkeypatch):
    inp = make_project(tmp_path, numb_steps=8, save_freq=4, disp_freq=1)
    used: list[int] = []
    close = ListPrefetcher.close

    def counting_close(self):
        used.append(self.used)
        close(self)

    monkeypatch.setattr(prefetch_module.ListPrefetcher, "close", counting_close)
    assert _train(_with(inp, nlist_prefetch=0), tmp_path / "off") == 0
    assert used == []
    assert _train(_with(inp, nlist_prefetch=2), tmp_path / "on") == 0
    assert used and used[-1] > 0  # the steps took lists built ahead
    off, on = tmp_path / "off", tmp_path / "on"
    assert (on / "lcurve.out").read_bytes() == (off / "lcurve.out").read_bytes()
    assert (
        max_param_diff(load_params(on / "model.ckpt-8.pt"), load_params(off / "model.ckpt-8.pt"))
        == 0
    )
    # interrupted after step 4 and continued, with lists built ahead: the same run again
    part = tmp_path / "part"
    assert _train(_with(inp, nlist_prefetch=2), part) == 0
    (part / "model.ckpt-8.pt").unlink()  # as if killed right after the save of step 4
    assert (
        _train(_with(inp, nlist_prefetch=2), part, "--restart", str(part / "model.ckpt-4.pt")) == 0
    )
    assert (part / "lcurve.out").read_bytes() == (off / "lcurve.out").read_bytes()
    assert (
        max_param_diff(load_params(part / "model.ckpt-8.pt"), load_params(off / "model.ckpt-8.pt"))
        == 0
    )
    assert not _threads()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_error_in_a_step_leaves_no_thread(tmp_path, monkeypatch, error):
    """Ctrl-C (the command returns 130) or any failure of a step ends the thread."""
    from mdtrain.train.loop import Trainer

    inp = make_project(tmp_path, numb_steps=8)
    apply = Trainer.apply_gradients
    calls = []

    def failing(self):
        calls.append(self.prefetch.pending())
        if len(calls) == 3:
            assert _threads()  # it was running
            raise error("stop")
        apply(self)

    monkeypatch.setattr(Trainer, "apply_gradients", failing)
    if error is KeyboardInterrupt:
        assert _train(inp, tmp_path / "out") == 130
    else:
        with pytest.raises(error):
            _train(inp, tmp_path / "out")
    assert not _threads()
    assert max(calls) <= 3 * 2  # this step's batch and two ahead, batch size 2


def test_a_prefetcher_dropped_without_close_ends_its_thread(system):
    """A trainer stepped by hand (tests, benchmarks) never reaches the loop's close: freeing
    the prefetcher ends the thread instead of leaving it waiting for good."""
    prefetcher = ListPrefetcher(NeighborListCache(), (RCUT, SEL, PER_TYPE))
    prefetcher.plan([(system, np.array([0]))])
    _wait(prefetcher, 1)
    thread = prefetcher._thread
    assert thread is not None and thread.is_alive()
    del prefetcher
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_lists_built_ahead_arrive_compact_and_meet_the_neighbour_limit_in_the_step(system):
    """The thread hands over the lists as the cache keeps them (int32, int8, the counts'
    maximum per type); a frame with more neighbours than the limit still fails in the step,
    with the message of a list built there."""
    from mdtrain.batching import NeighborLimit
    from mdtrain.errors import MDTrainError

    counts = PER_TYPE.build(*_frame(system, 4), system.atype, RCUT, SEL)[2]
    found = [int(n) for n in counts.max(axis=0)]
    messages = []
    for ahead in (False, True):
        cache = NeighborListCache(limit=NeighborLimit((found[0], found[1] - 1), "a test"))
        prefetcher = ListPrefetcher(cache, (RCUT, SEL, PER_TYPE)) if ahead else None
        cache.ahead = prefetcher
        try:
            if prefetcher is not None:
                prefetcher.plan([(system, np.array([4]))])
                _wait(prefetcher, 1)
                built = prefetcher._ready[cache.key(system, 4, PER_TYPE, RCUT, SEL)]
                assert built[0].dtype == np.int32 and built[1].dtype == np.int8
                assert built[2].tolist() == [found]  # all the limit check reads
            with pytest.raises(MDTrainError) as error:
                make_batch(system, [4], RCUT, SEL, cache=cache)
            messages.append(str(error.value))
        finally:
            if prefetcher is not None:
                prefetcher.close()
    assert messages[0] == messages[1] and f"{found[1]} neighbours of type 1" in messages[0]


def _frame(system, frame: int) -> tuple:
    frames = system.frames([frame], labels=())
    return frames["coord"][0], None if frames.get("box") is None else frames["box"][0]


def test_the_lookahead_kept_between_steps_foresees_what_a_fresh_peek_does(system, monkeypatch):
    """One copy per sampler, drawn one batch further each step, gives every step the
    batches `coming` gives from a fresh copy: across epochs, a new batch scale and a
    shrinking depth (the run's last steps); a changed scale starts a new copy."""
    copies = []
    copy_ahead = TrainingSampler.copy_ahead

    def counted(self):
        copies.append(self)
        return copy_ahead(self)

    samplers = [TrainingSampler([10, 4], [2, 1], [0.6, 0.4], seed=s) for s in (5, 6)]
    twins = [TrainingSampler([10, 4], [2, 1], [0.6, 0.4], seed=s) for s in (5, 6)]
    systems = [system, system]
    lookahead = prefetch_module.Lookahead(systems)
    for step in range(30):
        scale = 1 if step < 20 else 2
        depth = min(2, 28 - step) if step != 25 else 0  # 0: a step with nothing ahead
        current = [s.next_batch(scale) for s in samplers]
        expected = coming(systems, twins, [t.next_batch(scale) for t in twins], depth, scale)
        monkeypatch.setattr(TrainingSampler, "copy_ahead", counted)
        got = lookahead.batches(samplers, current, depth, scale)
        monkeypatch.setattr(TrainingSampler, "copy_ahead", copy_ahead)
        assert [f.tolist() for _, f in got] == [f.tolist() for _, f in expected]
    # each sampler once and once more at the new scale; none where nothing is to be foreseen
    assert len(copies) == 4


def test_lists_complete_once_every_training_frame_is_kept(system, tmp_path):
    """The trainer skips planning once the cache holds every training frame's lists (and
    only then): a frame not kept, or a cache grown by other frames, keeps it planning."""
    cache = NeighborListCache()
    prefetcher = ListPrefetcher(cache, (RCUT, SEL, PER_TYPE))
    other_path = tmp_path / "other"
    write_npy_system(other_path, **water_labeled(3, 8, 6.0, 9))
    other = open_system(str(other_path), ["O", "H"])
    systems = [system, other]
    assert not prefetcher.lists_complete(systems)
    make_batch(other, [0, 1, 2], RCUT, SEL, "cpu", cache)  # another system's frames first
    assert not prefetcher.lists_complete(systems)
    for frame in range(system.nframes - 1):
        make_batch(system, [frame], RCUT, SEL, "cpu", cache)
        assert not prefetcher.lists_complete(systems)
    prefetcher.plan([(system, np.array([system.nframes - 1]))])  # the last frame, ahead
    _wait(prefetcher, 1)
    assert not prefetcher.lists_complete(systems)  # built, not yet kept
    make_batch(system, [system.nframes - 1], RCUT, SEL, "cpu", cache)
    assert prefetcher.lists_complete(systems)
    assert prefetcher.pending() == 0
    prefetcher.close()


def test_a_full_cache_never_completes(system):
    cache = NeighborListCache(max_bytes=1)  # keeps nothing
    prefetcher = ListPrefetcher(cache, (RCUT, SEL, PER_TYPE))
    for frame in range(system.nframes):
        make_batch(system, [frame], RCUT, SEL, "cpu", cache)
    assert not prefetcher.lists_complete([system])
