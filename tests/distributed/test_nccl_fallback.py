"""An NCCL process group that does not form (a broken NCCL install, a node without the
interconnect it expects) falls back to Gloo with one warning when the backend is ``auto`` (or
``fallback`` is on); all ranks take the same decision, even when NCCL failed on one rank
only. Simulated without a GPU: ``auto`` is made to choose NCCL, and NCCL's group fails."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from mdtrain import distributed as dist_rt
from tests.helpers.processes import spawn_workers

pytestmark = pytest.mark.multiprocess

SIMULATED = "NCCL error in: ProcessGroupNCCL.cpp:1999, unhandled system error (simulated)"


def _group_with_failing_nccl(request: str, fallback: bool) -> tuple[str, float]:
    """The ranks listed in FAILING_NCCL cannot form an NCCL group; on the others NCCL's
    group "forms" as a lazily initialised one does: without a word to the other ranks yet."""
    real_init = torch.distributed.init_process_group
    failing = os.environ["FAILING_NCCL"].split(",")

    def init(backend: str, *args: object, **kwargs: object) -> None:
        if "nccl" not in backend:
            real_init(backend, *args, **kwargs)
        elif os.environ["RANK"] in failing:
            raise RuntimeError(SIMULATED)

    with (
        mock.patch("mdtrain.distributed.runtime.choose_backend", lambda *a, **k: "nccl"),
        mock.patch.object(torch.distributed, "init_process_group", init),
        dist_rt.init_distributed(request, fallback, timeout_s=60) as runtime,
    ):
        total = dist_rt.all_reduce_sum(torch.tensor([runtime.rank + 1.0])).item()
        return runtime.backend, total


@pytest.mark.parametrize("failing", ["0,1", "1"])
def test_auto_falls_back_to_gloo_when_nccl_does_not_form(failing):
    outcomes = spawn_workers(
        _group_with_failing_nccl, 2, ("auto", False), env={"FAILING_NCCL": failing}
    )
    assert all(o.ok for o in outcomes), "\n".join(o.describe() for o in outcomes)
    assert [o.value for o in outcomes] == [("gloo", 3.0), ("gloo", 3.0)]
    first = failing.split(",")[0]
    warning = f"WARNING backend 'nccl': the process group did not form (rank {first}: {SIMULATED}"
    assert outcomes[0].stderr.count(warning) == 1, outcomes[0].stderr
    assert "backend 'nccl'" not in outcomes[1].stderr  # said once, by rank 0


def test_a_forced_nccl_without_fallback_stops_every_rank():
    outcomes = spawn_workers(
        _group_with_failing_nccl, 2, ("nccl", False), env={"FAILING_NCCL": "1"}
    )
    for outcome in outcomes:
        assert outcome.error_type == "MDTrainError", outcome.describe()
        assert "backend nccl): rank 1: NCCL error in" in outcome.error_message
