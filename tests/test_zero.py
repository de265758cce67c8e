"""ZeRO-1 shard plans and DeadPool's shard packing and replay, on real optimizers (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from runner.checkpoint.zero_state import own_state_by_param
from runner.training.shard_state import ShardPacker, UpdateRecord, describe, replay, unpack
from runner.training.zero import ShardPlan, ZeroOne


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _adamw(module: torch.nn.Module) -> torch.optim.AdamW:
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def test_balanced_plan_gives_every_parameter_one_owner_and_keeps_group_order():
    params = [torch.zeros(n) for n in (100, 10, 60, 50, 5)]
    plan = ShardPlan.balanced(params, [[0, 2], [1, 3, 4]], dp=2)
    assert sorted(i for r in range(2) for i in plan.flat_shard(r)) == [0, 1, 2, 3, 4]
    loads = [sum(params[i].numel() for i in plan.flat_shard(r)) for r in range(2)]
    assert max(loads) - min(loads) <= 45  # whole tensors, largest first: 100 | 60+50+10+5
    for r in range(2):
        assert plan.shard(r) == [[i for i in g if plan.owner[i] == r] for g in plan.groups]


def test_sharded_optimizer_keeps_groups_and_zero_grad_clears_every_gradient():
    module = _module()
    opt = _adamw(module)
    zero = ZeroOne(module, opt, dp=2)
    zero.shard_for(1)
    assert len(opt.param_groups) == 2
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    assert owned == {id(zero.params[i]) for i in zero.plan.flat_shard(1)}
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in module.parameters())


def test_packed_shard_round_trips_and_replay_is_the_same_update_bit_for_bit():
    module = _module()
    opt = _adamw(module)
    params = [p for g in opt.param_groups for p in g["params"]]
    groups = [gi for gi, g in enumerate(opt.param_groups) for _ in g["params"]]
    gens = []
    for step in range(3):  # three real updates; keep the state after the first and the next two updates' inputs
        grads = [torch.randn_like(p) for p in params]
        if step == 1:
            layout = describe(params, opt)
            data = ShardPacker().pack(params, opt, layout).clone()
        if step >= 1:
            gens.append(UpdateRecord(step + 1, [g.clone() for g in grads],
                                     [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]))
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for g in opt.param_groups:
            g["lr"] *= 0.5  # a schedule: the replay must use each update's own hyper-parameters
    base = unpack(layout, data, gen=1)
    assert base.gen == 1 and len(base.params) == len(params)
    rebuilt = replay(opt, base, groups, gens)
    assert rebuilt.gen == 3 and rebuilt.base_gen == 1
    for pos, p in enumerate(params):
        assert torch.equal(rebuilt.params[pos], p.detach())
        for key, value in opt.state[p].items():
            assert torch.equal(rebuilt.state[pos][key], value), key


def test_a_shard_is_lost_only_with_its_holder_or_without_deadpool():
    from omegaconf import OmegaConf

    from runner.control.decision import shards_without_copy

    cfg = OmegaConf.create({"parallel": {"nodes": 3, "procs_per_node": 2, "zero": 1}})
    assert shards_without_copy(cfg, ["deadpool"], [2, 3]) == []  # a whole node: replicas are on the next one
    assert shards_without_copy(cfg, ["deadpool"], [2, 4]) == [2]  # rank 2's holder is rank 4
    assert shards_without_copy(cfg, ["deadpool"], [4, 0]) == [4]  # wraps around: rank 4's holder is rank 0
    assert shards_without_copy(cfg, ["flash_ckpt"], [1]) == [1]  # nothing replicates shards
    assert shards_without_copy(OmegaConf.create({"parallel": {"zero": 0}}), [], [1]) == []


def test_while_ndb_covers_a_rank_no_shard_has_a_copy_and_a_second_failure_is_not_recovered():
    from runner.control.decision import decide, shards_without_copy
    from tests.test_config import _compose

    cfg = _compose("+recipe=gpt_tiny", "parallel.zero=1", "parallel.nodes=3", "parallel.procs_per_node=1",
                   "ft=[ndb,deadpool]")
    ft = ["ndb", "deadpool"]
    assert shards_without_copy(cfg, ft, [0]) == []  # rank 0's replica is on rank 1
    assert shards_without_copy(cfg, ft, [0], covered=[2]) == [0]  # NDB covers rank 2: replication is suspended
    crash = dict(ft=ft, cfg=cfg, dead=[0], hung=False, lost_nodes=[], lost_ranks=[], survivors=[1], restarts_left=3)
    assert decide(**crash).action != "fail"
    second = decide(**crash, no_snapshots=[2])
    assert (second.action, second.fault_class) == ("fail", "replica_lost")
    assert "replication is suspended while NDB covers logical rank(s) [2]" in second.reason


def _shard_copy(zero: ZeroOne) -> tuple[list[torch.Tensor], dict]:
    """A copy of a rank's shard as DeadPool's replica holds it: the tensors its optimizer steps, their state."""
    own = zero.own_optimizer_params()
    return [p.detach().clone() for p in own], {pos: dict(zero.optimizer.state[p]) for pos, p in enumerate(own)}


@pytest.mark.parametrize("master_weights", [False, True], ids=["fp32", "master_weights"])
def test_a_carried_shard_is_updated_as_its_owner_would_update_it_bit_for_bit(master_weights):
    """NDB: rank 0 carries rank 1's shard from a copy of it; from then on both update it alike."""
    ranks = []
    for r in range(2):
        module = _module().to(torch.bfloat16) if master_weights else _module()
        zero = ZeroOne(module, _adamw(module), dp=2, master_weights=master_weights)
        zero.shard_for(r)
        ranks.append(zero)

    def step(zeros: list[ZeroOne], grads: list[torch.Tensor]) -> None:
        for zero in zeros:
            for p, g in zip(zero.params, grads):
                p.grad = g.clone()
            zero.optimizer.step()
            zero.step_carried()
            for shard in zero.sent_by(zero.rank):  # the all-gather, by hand
                for i in zero.plan.flat_shard(shard):
                    for other in zeros:
                        other.params[i].data.copy_(zero.params[i].data)

    torch.manual_seed(1)
    dtype = ranks[0].params[0].dtype
    for _ in range(2):
        step(ranks, [torch.randn(p.shape).to(dtype) for p in ranks[0].params])
    owner, carrier = ranks[1], ranks[0]
    carrier.set_carriers({1: 0})
    assert carrier.sent_by(0) == [0, 1]
    carrier.carry(1, *_shard_copy(owner))
    assert carrier.carries(1)
    for _ in range(3):
        grads = [torch.randn(p.shape).to(dtype) for p in carrier.params]
        step([carrier], grads)
        step([owner], grads)
    for i in owner.plan.flat_shard(1):
        assert torch.equal(carrier.params[i], owner.params[i])
    (params, state), (want_params, want_state) = carrier.carried_shard(1), _shard_copy(owner)  # what a replacement gets
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert state.keys() == want_state.keys()
    for pos, values in want_state.items():
        assert all(torch.equal(torch.as_tensor(state[pos][k]), torch.as_tensor(v)) for k, v in values.items())
    # a checkpoint gathers the carried shard's state as its owner's, fp32 masters included
    carried, owned = own_state_by_param(carrier, 0), own_state_by_param(owner, 1)
    assert set(owned) <= set(carried) and all(owned[i].keys() == carried[i].keys() for i in owned)
    for i, values in owned.items():
        assert all(torch.equal(torch.as_tensor(carried[i][k]), torch.as_tensor(v)) for k, v in values.items())
    carrier.set_carriers({})  # the owner has a process again
    assert not carrier.carries(1)


def test_replication_failing_twice_in_one_healthy_group_fails_the_run():
    """One failed exchange is a peer's fault until proven otherwise (the next collective finds it);
    a second one in the same group generation is not, and the run must not go on unprotected."""
    from types import SimpleNamespace

    from runner.recovery.deadpool.replication import ShardReplication
    from runner.training.comm import CollectiveFailure, RunFailedError

    outcomes = []

    class Replicator:
        drifts: list[int] = []  # replay's verifications: none here

        def wait(self):
            if outcomes.pop(0) == "fail":
                raise CollectiveFailure("shard replication failed: connection reset")

    emitted = []
    comm = SimpleNamespace(gen=3, logical_rank=1)
    events = SimpleNamespace(emit=lambda kind, **fields: emitted.append((kind, fields["gen"])))
    replication = ShardReplication(Replicator(), comm, events)

    outcomes[:] = ["fail", "ok", "fail"]
    for _ in range(3):  # a success in between: failures are not "in a row"
        replication.wait_previous()
    comm.gen = 4  # a recovery regrouped: the earlier failure was the lost peer's
    outcomes[:] = ["fail", "fail"]
    replication.wait_previous()
    with pytest.raises(RunFailedError, match="failed twice in a row while every rank was alive"):
        replication.wait_previous()
    assert emitted == [("replication_failed", 3), ("replication_failed", 3),
                       ("replication_failed", 4), ("replication_failed", 4)]


def test_a_drifted_replica_found_by_a_verification_is_logged_once():
    """Replay: the drifts a verification found (and reseeded) become replica_drift events after the wait, once each."""
    from types import SimpleNamespace

    from runner.recovery.deadpool.replication import ShardReplication

    class Replicator:
        drifts = [50]

        def wait(self):
            pass

        def partner(self, logical_rank):
            return logical_rank - 2

    emitted = []
    events = SimpleNamespace(emit=lambda kind, **fields: emitted.append((kind, fields)))
    replication = ShardReplication(Replicator(), SimpleNamespace(gen=3, logical_rank=2), events)
    replication.wait_previous()
    replication.wait_previous()
    assert [(kind, f["step"], f["owner"], f["holder"]) for kind, f in emitted] == [("replica_drift", 50, 0, 2)]
