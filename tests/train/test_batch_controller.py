"""Micro-batch controller: same gradient as the full batch, retry policy, collective agreement."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from mdtrain import memory
from mdtrain.errors import MDTrainError
from mdtrain.train.batch_controller import MicroBatchController, frame_weights, split_frames


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


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
class TinyEnergyModel(torch.nn.Module):
    """A per-atom energy from pair distances, forces by autograd (as in the real model)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.w1 = torch.nn.Parameter(torch.randn(1, 6, generator=gen, dtype=torch.float64))
        self.w2 = torch.nn.Parameter(torch.randn(6, 1, generator=gen, dtype=torch.float64))

    def forward(self, coord: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coord = coord.requires_grad_(True)
        r2 = ((coord[:, :, None, :] - coord[:, None, :, :]) ** 2).sum(-1)
        density = torch.exp(-r2).sum(-1, keepdim=True) - 1.0  # the self term is exp(0) = 1
        atom_e = (torch.tanh(density @ self.w1) @ self.w2)[..., 0]
        energy = atom_e.sum(-1)
        (grad,) = torch.autograd.grad(energy.sum(), coord, create_graph=True)
        return energy, -grad


def _loss(model, coord, e_ref, f_ref):
    """Mean over frames, like the energy/force loss (one system per batch: equal natoms)."""
    energy, force = model(coord.clone())
    natoms = coord.shape[1]
    le = ((energy - e_ref) / natoms) ** 2
    lf = ((force - f_ref) ** 2).mean(dim=(1, 2))
    return (0.7 * le + 3.0 * lf).mean()


def _batch(nframes=7, natoms=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    coord = torch.rand(nframes, natoms, 3, generator=gen, dtype=torch.float64) * 3
    e_ref = torch.randn(nframes, generator=gen, dtype=torch.float64)
    f_ref = torch.randn(nframes, natoms, 3, generator=gen, dtype=torch.float64)
    return coord, e_ref, f_ref


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _accumulate(model, batch, slices, fail_above=None):
    """attempt_fn body: local gradient accumulation over micro-batches, weighted by frames."""
    coord, e_ref, f_ref = batch
    nframes = coord.shape[0]
    for s, w in zip(slices, frame_weights(slices, nframes), strict=True):
        if fail_above is not None and s.stop - s.start > fail_above:
            raise _oom()
        (w * _loss(model, coord[s], e_ref[s], f_ref[s])).backward()
    return len(slices)


def test_accumulated_gradient_equals_full_batch_gradient():
    model, batch = TinyEnergyModel(), _batch()
    _loss(model, *batch).backward()
    reference = _grads(model)
    for nsplit in range(2, 8):
        model.zero_grad(set_to_none=True)
        _accumulate(model, batch, split_frames(7, nsplit))
        for got, ref in zip(_grads(model), reference, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_run_step_discards_partial_gradients_of_failed_attempts():
    model, batch = TinyEnergyModel(), _batch(nframes=8)
    _loss(model, *batch).backward()
    reference = _grads(model)
    ctrl = MicroBatchController()

    def attempt(slices):
        # the failure comes after backward, so a failed attempt leaves partial gradients
        coord, e_ref, f_ref = batch
        for s, w in zip(slices, frame_weights(slices, 8), strict=True):
            (w * _loss(model, coord[s], e_ref[s], f_ref[s])).backward()
            if s.stop - s.start > 2:
                raise _oom()
        return len(slices)

    used = ctrl.run_step(attempt, 8, 5, "sys", zero_grad=lambda: model.zero_grad(set_to_none=True))
    assert used == 4 and ctrl.nsplit == 4
    for got, ref in zip(_grads(model), reference, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ policy
def test_on_oom_doubles_and_raises_at_one_frame_per_micro_batch():
    ctrl = MicroBatchController()
    assert [ctrl.on_oom(6, 192, "water/a") for _ in range(3)] == [2, 4, 8]
    assert ctrl.split(6) == split_frames(6, 6)
    with pytest.raises(MDTrainError, match=r"system water/a: a single frame of 192 atoms"):
        ctrl.on_oom(6, 192, "water/a")


def test_run_step_raises_the_too_large_frame_error_after_trying_every_split():
    ctrl = MicroBatchController()
    tried = []

    def attempt(slices):
        tried.append(len(slices))
        raise _oom()

    with pytest.raises(MDTrainError, match="a single frame of 300 atoms does not fit"):
        ctrl.run_step(attempt, 5, 300, "big")
    assert tried == [1, 2, 4, 5]


def test_non_oom_errors_propagate_without_retry():
    ctrl = MicroBatchController()
    calls = []

    def attempt(slices):
        calls.append(1)
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        ctrl.run_step(attempt, 4, 3, "s")
    assert calls == [1] and ctrl.nsplit == 1


def _drive(ctrl, steps, fits_frames, nframes=16):
    """Run ``steps`` steps where a micro-batch fits only up to ``fits_frames`` frames."""
    history = []
    for _ in range(steps):
        ctrl.run_step(lambda sl: _accumulate_fake(sl, fits_frames), nframes, 10, "s")
        history.append(ctrl.nsplit)
    return history


def _accumulate_fake(slices, fits_frames):
    if max(s.stop - s.start for s in slices) > fits_frames:
        raise _oom()
    return None


def test_retry_halves_after_interval_and_backs_off_when_it_fails(caplog):
    ctrl = MicroBatchController(retry_interval=5)
    with caplog.at_level(logging.INFO, logger="mdtrain.train.batch"):
        history = _drive(ctrl, 40, fits_frames=4)
    # 16 frames, 4 fit: nsplit 4 is needed; halvings to 2 fail, the wait doubles each time
    assert [k + 1 for k, n in enumerate(history) if n == 2] == [5, 15, 35]
    assert set(history) == {2, 4}
    assert ctrl.best_nsplit == 4
    trials = [r for r in caplog.records if "trying" in r.getMessage()]
    assert len(trials) == 3  # after 5, then 10, then 20 successes: 35 of 40 steps
    assert ctrl.wait == 40
    # every change is logged once, never every step
    assert len(caplog.records) < 15


def test_retry_returns_to_one_when_memory_allows():
    ctrl = MicroBatchController(retry_interval=3)
    _drive(ctrl, 1, fits_frames=4)
    assert ctrl.nsplit == 4
    history = _drive(ctrl, 12, fits_frames=16)
    assert history == [4, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert ctrl.best_nsplit == 1 and ctrl.wait == 3


def test_split_memory_survives_restart():
    ctrl = MicroBatchController(retry_interval=5)
    _drive(ctrl, 3, fits_frames=2)
    clone = MicroBatchController(retry_interval=5)
    clone.load_state_dict(ctrl.state_dict())
    assert clone.state_dict() == ctrl.state_dict()
    assert clone.split(16) == split_frames(16, 8)


def test_grow_scales_batches_and_reverts_on_oom():
    ctrl = MicroBatchController(retry_interval=2, grow=True, max_scale=8)
    scales = []
    for _ in range(8):
        ctrl.on_success()
        scales.append(ctrl.suggest_growth())
    assert scales == [1, 2, 2, 4, 4, 8, 8, 8]
    # a step at scale 8 runs out of memory: retried as two halves, next batches at scale 4
    tried = []

    def attempt(slices):
        tried.append(len(slices))
        if len(slices) == 1:
            raise _oom()

    ctrl.run_step(attempt, 16, 12, "s")
    assert tried == [1, 2]
    assert ctrl.nsplit == 1 and ctrl.batch_scale == 4
    for _ in range(10):
        ctrl.on_success()
    assert ctrl.batch_scale == 4  # never grows again to a size that failed


def test_no_growth_unless_enabled_or_while_split():
    ctrl = MicroBatchController(retry_interval=1, max_scale=8)
    for _ in range(5):
        ctrl.on_success()
    assert ctrl.batch_scale == 1
    ctrl = MicroBatchController(retry_interval=100, grow=True, max_scale=8)
    ctrl.on_oom(8, 3, "s")
    for _ in range(99):
        ctrl.on_success()
    assert ctrl.batch_scale == 1 and ctrl.nsplit == 2


# ------------------------------------------------------------------ two ranks (Gloo)
def _rank_main(rank, world, init_file, sim_atoms, queue):
    os.environ[memory.SIMULATE_ATOMS_ENV] = str(sim_atoms)
    os.environ[memory.SIMULATE_RANKS_ENV] = "1"
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:

        def any_rank(flag: bool) -> bool:
            t = torch.tensor([int(flag)])
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            return bool(t.item())

        model = TinyEnergyModel()
        natoms = 4
        batch = _batch(nframes=6 - 2 * rank, natoms=natoms, seed=rank)  # 6 and 4 frames
        nframes = batch[0].shape[0]
        _loss(model, *batch).backward()
        reference = _grads(model)
        for g in reference:
            torch.distributed.all_reduce(g)
            g /= world

        def attempt(slices):
            coord, e_ref, f_ref = batch
            for s, w in zip(slices, frame_weights(slices, nframes), strict=True):
                memory.maybe_simulate_oom((s.stop - s.start) * natoms, rank)
                (w * _loss(model, coord[s], e_ref[s], f_ref[s])).backward()
            return len(slices)

        ctrl = MicroBatchController()
        result = {"rank": rank}
        try:
            result["used"] = [
                ctrl.run_step(
                    attempt,
                    nframes,
                    natoms,
                    f"sys{rank}",
                    any_rank,
                    zero_grad=lambda: model.zero_grad(set_to_none=True),
                )
                for _ in range(2)
            ]
            grads = _grads(model)
            for g in grads:
                torch.distributed.all_reduce(g)
                g /= world
            result["grad_err"] = max(
                float((g - r).abs().max()) for g, r in zip(grads, reference, strict=True)
            )
        except MDTrainError as exc:
            result["error"] = str(exc)
        result["nsplit"] = ctrl.nsplit
        result["oom_count"] = ctrl.oom_count
        queue.put(result)
    finally:
        torch.distributed.destroy_process_group()


def _run_two_ranks(tmp_path, sim_atoms, timeout=90.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = tmp_path / "rendezvous"
    procs = [
        ctx.Process(target=_rank_main, args=(r, 2, str(init_file), sim_atoms, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                results.append(queue.get(timeout=1.0))
            except Exception:  # queue.Empty: check the processes are alive
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert len(results) == 2, f"ranks did not finish: exit codes {[p.exitcode for p in procs]}"
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.multiprocess
def test_two_ranks_agree_when_only_one_runs_out_of_memory(tmp_path):
    # rank 1 (4 frames × 4 atoms) fails above 8 atoms: it needs micro-batches of 2 frames
    r0, r1 = _run_two_ranks(tmp_path, sim_atoms=8)
    assert r0["nsplit"] == r1["nsplit"] == 2
    assert r0["oom_count"] == r1["oom_count"] == 1
    assert r0["used"] == [2, 2] and r1["used"] == [2, 2]
    assert r0["grad_err"] < 1e-12 and r1["grad_err"] < 1e-12


@pytest.mark.multiprocess
def test_two_ranks_fail_together_when_a_frame_does_not_fit(tmp_path):
    r0, r1 = _run_two_ranks(tmp_path, sim_atoms=3)  # not even one 4-atom frame fits on rank 1
    assert "system sys1: a single frame of 4 atoms" in r1["error"]
    assert "another rank" in r0["error"]
    assert r0["nsplit"] == r1["nsplit"]
