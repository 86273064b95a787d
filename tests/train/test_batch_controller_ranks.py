"""Two real ranks (Gloo) drive the batch controller with batches of different sizes: they vote
the same number of times, retry together, keep their own split per size, and the averaged
gradient is the whole batches' one."""

from __future__ import annotations

import os

import pytest
import torch

from mdtrain import memory
from mdtrain.errors import MDTrainError
from mdtrain.train.batch_controller import MicroBatchController, frame_weights
from tests.helpers.micro_batch import TinyEnergyModel, grads, tiny_batch, tiny_loss
from tests.helpers.processes import free_port, run_workers

pytestmark = pytest.mark.multiprocess
NATOMS = 4
NFRAMES = (6, 4)  # rank 0: size 24, rank 1: size 16


def _rank_main(steps: int) -> dict:
    """One rank: ``steps`` controller steps on its own batch; what it did, for the parent."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        votes = [0]

        def any_rank(flag: bool) -> bool:
            votes[0] += 1
            t = torch.tensor([int(flag)])
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            return bool(t.item())

        model, nframes = TinyEnergyModel(), NFRAMES[rank]
        coord, e_ref, f_ref = tiny_batch(nframes=nframes, natoms=NATOMS, seed=rank)
        tiny_loss(model, coord, e_ref, f_ref).backward()
        reference = grads(model)
        tried: list[int] = []

        def attempt(slices: list[slice]) -> int:
            tried.append(len(slices))
            for s, w in zip(slices, frame_weights(slices, nframes), strict=True):
                memory.maybe_simulate_oom((s.stop - s.start) * NATOMS, rank)
                (w * tiny_loss(model, coord[s], e_ref[s], f_ref[s])).backward()
            return len(slices)

        ctrl = MicroBatchController()
        result: dict = {"rank": rank, "tried": tried}
        try:
            result["used"] = [
                ctrl.run_step(
                    attempt,
                    nframes,
                    NATOMS,
                    f"sys{rank}",
                    any_rank,
                    zero_grad=lambda: model.zero_grad(set_to_none=True),
                )  # fmt: skip
                for _ in range(steps)
            ]
            # the caller's all-reduce: the mean of every rank's whole-batch gradient
            for g in reference + (got := grads(model)):
                torch.distributed.all_reduce(g)
            result["grad_err"] = max(
                float((g - r).abs().max()) / world for g, r in zip(got, reference, strict=True)
            )
        except MDTrainError as exc:
            result["error"] = str(exc)
        result["votes"] = votes[0]
        result["oom_count"] = ctrl.oom_count
        result["splits"] = {size: s.nsplit for size, s in ctrl.sizes.items()}
        return result
    finally:
        torch.distributed.destroy_process_group()


# (simulated OOM above this many atoms, on these ranks (None: all), steps): one scenario each
ONLY_RANK1, BOTH, NO_FRAME_FITS = (8, "1", 2), (6, None, 2), (3, "1", 2)


def _scenarios(cases: list[tuple[int, str | None, int, int]]) -> list[dict]:
    """One rank: each scenario in turn, in a process group of its own (on its own port),
    with its OOM settings in the environment (read at every forward)."""
    results = []
    for limit, ranks, steps, port in cases:
        os.environ["MASTER_PORT"] = str(port)
        os.environ[memory.SIMULATE_ATOMS_ENV] = str(limit)
        os.environ.pop(memory.SIMULATE_RANKS_ENV, None)
        if ranks is not None:
            os.environ[memory.SIMULATE_RANKS_ENV] = ranks
        results.append(_rank_main(steps))
    return results


@pytest.fixture(scope="module")
def two_ranks() -> dict[tuple, tuple[dict, dict]]:
    """Every scenario's outcome on ranks 0 and 1: the scenarios run in turn on one pair of
    rank processes (each process imports torch once, not once per scenario)."""
    cases = [(*case, free_port()) for case in (ONLY_RANK1, BOTH, NO_FRAME_FITS)]
    r0, r1 = run_workers(_scenarios, 2, args=(cases,), timeout=150.0)
    return {case[:3]: (a, b) for case, a, b in zip(cases, r0, r1, strict=True)}


def test_only_the_rank_that_runs_out_of_memory_splits_its_size(two_ranks):
    # rank 1 (4 frames × 4 atoms) fails above 8 atoms: it needs micro-batches of 2 frames
    r0, r1 = two_ranks[ONLY_RANK1]
    assert r0["tried"] == [1, 1] and r1["tried"] == [1, 2, 2]  # rank 0 kept its gradients
    assert r0["used"] == [1, 1] and r1["used"] == [2, 2]
    assert r0["splits"] == {} and r1["splits"] == {16: 2}
    assert r0["oom_count"] == r1["oom_count"] == 1
    assert r0["votes"] == r1["votes"] == 3 + 1
    assert r0["grad_err"] < 1e-12 and r1["grad_err"] < 1e-12


def test_ranks_of_different_sizes_split_to_different_depths_and_vote_alike(two_ranks):
    # 6 atoms fit on both ranks: rank 0 (6 frames) needs 1 frame per micro-batch (1, 2, 4, 8),
    # rank 1 (4 frames) too (1, 2, 4) and waits one attempt for rank 0
    r0, r1 = two_ranks[BOTH]
    assert r0["tried"] == [1, 2, 4, 6, 6] and r1["tried"] == [1, 2, 4, 4]
    assert r0["splits"] == {24: 8} and r1["splits"] == {16: 4}
    assert r0["oom_count"] == r1["oom_count"] == 3
    assert r0["votes"] == r1["votes"] == 3 * 2 + 1 + 1
    assert r0["grad_err"] < 1e-12 and r1["grad_err"] < 1e-12


def test_two_ranks_fail_together_when_a_frame_does_not_fit(two_ranks):
    r0, r1 = two_ranks[NO_FRAME_FITS]  # not even one 4-atom frame fits on rank 1
    assert "system sys1: a single frame of 4 atoms" in r1["error"]
    assert "another rank" in r0["error"]
    assert r0["votes"] == r1["votes"]
