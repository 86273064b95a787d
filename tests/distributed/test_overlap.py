"""Gradient all-reduces overlapped with the backward, on real ranks (Gloo): the same bits as
all-reducing after the backward, also when one rank runs out of memory in the middle of its
last backward (after some buckets launched) and retries, and when a parameter gets no
gradient on one rank; and whole trainings with overlap on and off give the same lcurve and
parameters, bit for bit."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from mdtrain.distributed import GradientBuckets
from mdtrain.train.batch_controller import MicroBatchController, frame_weights
from tests.helpers.processes import run_workers
from tests.helpers.training import lcurve_rows, load_params, make_project, train_runs_on_ranks

pytestmark = pytest.mark.multiprocess
ONE_PARAM = 8 / 2**20  # bucket_mb: a bucket per parameter tensor


class _Fail(torch.autograd.Function):
    """Identity whose backward runs out of memory while ``armed[0]`` is set (once)."""

    armed = [False]

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        if _Fail.armed[0]:
            _Fail.armed[0] = False
            raise torch.OutOfMemoryError("CUDA out of memory. (test: inside the backward)")
        return g


class _Net(torch.nn.Module):
    """Three layers; ``extra`` only reached on rank 1 (no gradient on rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = torch.nn.Linear(3, 6).double()
        self.b = torch.nn.Linear(6, 6).double()
        self.extra = torch.nn.Parameter(torch.ones(6, dtype=torch.float64))
        self.c = torch.nn.Linear(6, 1).double()

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = _Fail.apply(torch.tanh(self.a(x)))
        h = torch.tanh(self.b(h))
        if use_extra:
            h = h * self.extra
        return self.c(h)[:, 0]


def _rank_main() -> dict:
    """Two steps with overlap on, then the same with overlap off, on fresh identical models;
    rank 1's first step runs out of memory inside its (armed) whole-batch backward."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
        y = torch.randn(4, generator=gen, dtype=torch.float64)
        votes = [0]

        def any_rank(flag: bool) -> bool:
            votes[0] += 1
            t = torch.tensor([int(flag)])
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            return bool(t.item())

        result: dict = {}
        for overlap in (True, False):
            net = _Net()
            buckets = GradientBuckets(net.parameters(), ONE_PARAM, overlap=overlap)
            ctrl = MicroBatchController()
            launched_at_failure: list[int] = []

            def attempt(
                slices: list[slice], net=net, buckets=buckets, overlap=overlap,
                launched_at_failure=launched_at_failure,
            ) -> int:  # fmt: skip
                for k, (s, w) in enumerate(zip(slices, frame_weights(slices, 4), strict=True)):
                    loss = w * ((net(x[s], rank == 1) - y[s]) ** 2).mean()
                    last = overlap and k == len(slices) - 1
                    try:
                        with buckets.launching() if last else contextlib.nullcontext():
                            loss.backward()
                    except torch.OutOfMemoryError:
                        launched_at_failure.append(buckets.launches)
                        raise
                return len(slices)

            grads, used = [], []
            for step in range(2):
                _Fail.armed[0] = rank == 1 and step == 0
                used.append(
                    ctrl.run_step(
                        attempt,
                        4,
                        1,
                        f"sys{rank}",
                        any_rank,
                        zero_grad=lambda net=net: net.zero_grad(set_to_none=True),
                        before_vote=buckets.launch_rest if overlap else None,
                    )  # fmt: skip
                )
                if overlap:
                    buckets.finish(world)
                else:
                    buckets.all_reduce(world)
                grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
            result[overlap] = {
                "grads": grads,
                "used": used,
                "launches": buckets.launches,
                "launched_at_failure": launched_at_failure,
                "nbuckets": len(buckets.buckets),
            }
        # the reference: every rank's whole-batch gradient, summed here once
        net = _Net()
        ((net(x, rank == 1) - y) ** 2).mean().backward()
        reference = {}
        for n, p in net.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            torch.distributed.all_reduce(g)
            reference[n] = g / world
        result["reference"] = reference
        result["votes"] = votes[0]
        return result
    finally:
        torch.distributed.destroy_process_group()


def test_overlap_survives_an_oom_inside_the_last_backward_and_matches_the_bits():
    r0, r1 = run_workers(_rank_main, 2, timeout=90.0)
    on0, on1, off0, off1 = r0[True], r1[True], r0[False], r1[False]
    nb = on0["nbuckets"]
    assert nb == 7
    # rank 1 failed after launching some buckets (not none, not all), retried as 2 halves
    assert on1["launched_at_failure"] and 0 < on1["launched_at_failure"][0] < nb
    assert on1["used"] == off1["used"] == [2, 2] and on0["used"] == [1, 1]
    # every rank launched each bucket once per attempt: 3 attempts (the failed one included)
    assert on0["launches"] == on1["launches"] == 3 * nb
    assert off0["launches"] == off1["launches"] == 2 * nb
    for step in range(2):
        for name, want in on0["grads"][step].items():
            for got in (on1["grads"][step][name], off0["grads"][step][name]):
                assert torch.equal(got, want), (step, name)  # the same bits everywhere
    # the average of the whole batches (rank 1's in two micro-batches: 1e-12)
    for name, want in r0["reference"].items():
        torch.testing.assert_close(on0["grads"][0][name], want, rtol=1e-12, atol=1e-15)
    # extra: zeros from rank 0, rank 1's gradient: half of it on both
    assert torch.count_nonzero(on0["grads"][0]["extra"]) == 6
    assert r0["votes"] == r1["votes"]


def _project(root, overlap: bool, **training: object):
    inp = make_project(root, numb_steps=4, save_freq=4, disp_freq=1, **training)
    config = json.loads(inp.read_text())
    config["training"]["distributed"] = {"overlap_comm": overlap, "bucket_mb": 0.002}
    inp.write_text(json.dumps(config))
    return inp


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[tuple[bool, bool], tuple]:
    """(oom, overlap): the output folder and log of a 4-step run on two ranks; all four runs
    in turn on one pair of rank processes."""
    root = tmp_path_factory.mktemp("overlap")
    oom_env = {"MDTRAIN_SIMULATE_OOM_ATOMS": "30", "MDTRAIN_SIMULATE_OOM_RANKS": "1"}
    cases = [(oom, overlap) for oom in (False, True) for overlap in (True, False)]
    inputs = [_project(root / f"oom{oom}-overlap{overlap}", overlap) for oom, overlap in cases]
    jobs = [(inp, inp.parent / "out", (), oom_env if oom else {})
            for inp, (oom, _) in zip(inputs, cases, strict=True)]  # fmt: skip
    logs = train_runs_on_ranks(jobs, timeout=120)
    return {
        case: (inp.parent / "out", log) for case, inp, log in zip(cases, inputs, logs, strict=True)
    }


@pytest.mark.parametrize("oom", [False, True], ids=["plain", "oom_on_rank1"])
def test_training_with_overlap_on_and_off_gives_the_same_bits(trained, oom):
    """float64, 2 ranks, 4 steps, buckets of 2 kB (several for the tiny model); with
    ``oom_on_rank1`` rank 1 runs out of memory (simulated, before each forward above 30
    atoms) and retries its steps in micro-batches while rank 0 waits with its gradients."""
    (on, on_log), (off, off_log) = trained[oom, True], trained[oom, False]
    assert ("out of memory" in on_log) == oom and ("out of memory" in off_log) == oom
    assert (on / "lcurve.out").read_text() == (off / "lcurve.out").read_text()
    assert len(lcurve_rows(on / "lcurve.out")) == 4
    a, b = load_params(on / "model.ckpt-4.pt"), load_params(off / "model.ckpt-4.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
