"""``training.zero_stage: 1`` on 2 Gloo ranks: the optimiser state sharded, the weights and
lcurve.out equal to plain data parallelism's to the last bit, checkpoints holding the whole
state (a restart, sharded or not, continues exactly), and every optimiser type of the
``optimizer`` section stepping its shard like the whole."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.processes import run_workers
from tests.helpers.training import make_project, train_runs_on_ranks

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180
TYPES = ("Adam", "AdamW", "AdaMuon", "HybridMuon")


def _assert_same_state(a: dict, b: dict) -> None:
    for key, value in a["model_state"].items():
        assert torch.equal(b["model_state"][key], value), key
    sa, sb = a["optimizer_state"], b["optimizer_state"]
    assert sa["param_groups"] == sb["param_groups"]
    assert sorted(sa["state"]) == sorted(sb["state"])
    for index, entry in sa["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(sb["state"][index][name]), torch.as_tensor(value))


def test_zero_stage_1_equals_plain_data_parallelism_and_restarts_exactly(tmp_path):
    inp = make_project(tmp_path, save_freq=3, disp_freq=1)
    zero = tmp_path / "zero.json"
    config = json.loads(inp.read_text())
    config["training"]["zero_stage"] = 1
    zero.write_text(json.dumps(config))
    # the sharded run continues from its own step-3 checkpoint in the third run
    restart = ("--restart", str(tmp_path / "zero" / "model.ckpt-3.pt"))
    train_runs_on_ranks(
        [(inp, tmp_path / "plain", (), {}), (zero, tmp_path / "zero", (), {}),
         (zero, tmp_path / "again", restart, {})],
        timeout=TIMEOUT,
    )  # fmt: skip
    plain_curve = (tmp_path / "plain" / "lcurve.out").read_bytes()
    assert (tmp_path / "zero" / "lcurve.out").read_bytes() == plain_curve
    final = [
        torch.load(tmp_path / d / "model.ckpt-6.pt", weights_only=True) for d in ("plain", "zero")
    ]
    _assert_same_state(final[0], final[1])
    # the same checkpoint format as plain runs (compared above); the sharded one continued
    _assert_same_state(
        final[0], torch.load(tmp_path / "again" / "model.ckpt-6.pt", weights_only=True)
    )


def _optimizer_types() -> dict:
    """Each rank: the same model and gradients; a plain optimiser and a sharded one, 3 steps,
    the consolidated state, then one more step of a sharded optimiser restored from it."""
    from mdtrain import distributed as dist_rt
    from mdtrain.model.backend import build_model
    from mdtrain.train.optimizer import make_optimizer
    from mdtrain.train.zero import ShardedOptimizer
    from tests.helpers.models import small_config

    torch.distributed.init_process_group("gloo")
    rank, world = dist_rt.get_rank(), dist_rt.get_world_size()

    results = {}
    for kind in TYPES:
        section = {"type": kind}
        models = [build_model(small_config(), backend="reference") for _ in range(3)]
        for m in models[1:]:
            m.load_state_dict(models[0].state_dict())
        initial = [p.detach().clone() for p in models[0].parameters()]
        named = [[(n, p) for n, p in m.named_parameters()] for m in models]

        def build(part, section=section):
            return make_optimizer(section, part, 1e-3)

        plain = build(named[0])
        sharded = ShardedOptimizer(build, named[1], rank, world)
        owned = sum(1 for o in sharded.owner if o == rank)
        gen = torch.Generator().manual_seed(5)
        grads = [[torch.randn(p.shape, generator=gen, dtype=p.dtype) for _, p in named[0]]
                 for _ in range(4)]  # fmt: skip
        for step in range(3):
            for opt, pairs in ((plain, named[0]), (sharded, named[1])):
                for (_, p), g in zip(pairs, grads[step]):
                    p.grad = g.clone()
                opt.step()
        reference = plain.state_dict()["state"]
        reference = {
            i: {k: torch.as_tensor(v).clone() for k, v in e.items()} for i, e in reference.items()
        }
        sharded.consolidate()
        whole = sharded.state_dict() if rank == 0 else None
        whole = dist_rt.broadcast_object(whole)
        same_state = sorted(whole["state"]) == sorted(reference) and all(
            torch.equal(torch.as_tensor(whole["state"][i][k]), v)
            for i, entry in reference.items()
            for k, v in entry.items()
        )
        restored = ShardedOptimizer(build, named[2], rank, world)
        models[2].load_state_dict(models[1].state_dict())
        restored.load_state_dict(whole)
        for opt, pairs in ((plain, named[0]), (restored, named[2])):
            for (_, p), g in zip(pairs, grads[3]):
                p.grad = g.clone()
            opt.step()
        # the last step (plain) against the restored sharded optimiser's
        diff = max(
            float((a - b).abs().max())
            for a, b in zip(models[0].parameters(), models[2].parameters())
        )
        moved = any(not torch.equal(p, q) for p, q in zip(models[0].parameters(), initial))
        results[kind] = {"owned": owned, "diff": diff, "same_state": same_state, "moved": moved}
    torch.distributed.destroy_process_group()
    return results


def test_every_optimizer_type_steps_its_shard_like_the_whole():
    r0, r1 = run_workers(_optimizer_types, 2, timeout=120.0)
    for kind in TYPES:
        assert r0[kind]["owned"] > 0 and r1[kind]["owned"] > 0
        assert r0[kind]["same_state"], kind
        assert r0[kind]["moved"], kind
        assert r0[kind]["diff"] == 0.0 and r1[kind]["diff"] == 0.0, (kind, r0, r1)
