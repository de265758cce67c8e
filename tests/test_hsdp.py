"""DP replica groups (HSDP, ``parallel.dp_group_size``) and ZeRO-1 at pp > 1, without processes: the Topology's
shard groups and replica-group peers, what the config accepts and refuses, the plan's shard and who holds a lost
rank's shard. The real-process runs are in tests/test_flashrecovery.py and tests/test_pp_training.py."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.config.validate import validate
from runner.control.decision import shards_without_copy
from runner.planning.plan import apply_smoke, make_plan
from runner.planning.topology import Topology
from tests.test_config import _compose

FOUR = ["+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2"]  # dp=4
HSDP = ["parallel.zero=1", "parallel.dp_group_size=2"]


def test_replica_groups_split_the_dp_dimension_into_shard_groups():
    t = Topology(nodes=2, procs_per_node=2, dp_group_size=2)
    assert (t.shard_group_size, t.replica_groups) == (2, 2)
    assert [t.shard_index(r) for r in range(4)] == [0, 1, 0, 1]
    assert [t.shard_group(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [t.replica_group_peer(r) for r in range(4)] == [2, 3, 0, 1]  # the same shard in the other group
    assert [t.shard_copies(r) for r in range(4)] == [[2], [3], [0], [1]]


def test_three_replica_groups_list_every_copy_of_a_shard_nearest_first():
    t = Topology(nodes=3, procs_per_node=2, dp_group_size=2)
    assert t.replica_groups == 3 and t.shard_copies(1) == [3, 5] and t.shard_copies(5) == [1, 3]


def test_a_shard_group_keeps_the_pp_and_tp_coordinate():
    t = Topology(nodes=2, procs_per_node=4, pp=2, dp_group_size=2)  # dp=4: replicas 0, 1 | 2, 3
    for r in range(t.world):
        dp, pp, tp = t.coords(r)
        assert [t.coords(m) for m in t.shard_group(r)] == [(dp - dp % 2 + i, pp, tp) for i in range(2)]
        assert t.coords(t.replica_group_peer(r)) == ((dp + 2) % 4, pp, tp)
    assert t.shard_group(3) == [1, 3] and t.replica_group_peer(3) == 7


@pytest.mark.parametrize("size", [0, 4])
def test_one_replica_group_is_the_whole_dp_group_and_has_no_peer(size):
    t = Topology(nodes=2, procs_per_node=2, dp_group_size=size)
    assert t.replica_groups == 1 and t.shard_group(2) == t.dp_group(2) == [0, 1, 2, 3]
    assert [t.shard_index(r) for r in range(4)] == [0, 1, 2, 3]
    assert t.replica_group_peer(1) is None and t.shard_copies(1) == []


def test_a_group_size_that_does_not_divide_dp_is_refused():
    with pytest.raises(ValueError, match="dp_group_size=3 must be 0 .* or divide the data-parallel size 4"):
        Topology(nodes=2, procs_per_node=2, dp_group_size=3)
    assert Topology.from_cfg(_compose(*FOUR, *HSDP)).dp_group_size == 2


@pytest.mark.parametrize("overrides", [
    [*HSDP, "ft=[flashrecovery]"],  # the payoff: a restarted rank's shard comes from the other replica group
    [*HSDP, "ft=[flashrecovery,flash_ckpt]"],
    [*HSDP, "ft=[flash_ckpt]"],
    HSDP,
    ["parallel.zero=1", "parallel.pp=2"],  # ZeRO-1 at pp > 1
    ["parallel.zero=1", "parallel.pp=2", "ft=[flash_ckpt]"],
    ["parallel.zero=1", "parallel.pp=2", "parallel.dp_group_size=1", "ft=[flashrecovery]"],
])
def test_what_replica_groups_and_zero1_at_pp2_train_with_validates(overrides):
    validate(_compose(*FOUR, *overrides))


@pytest.mark.parametrize("overrides, says", [
    (["parallel.zero=1", "ft=[flashrecovery]"], "or set parallel.dp_group_size to a divisor of the data-parallel "
                                                "size 4 below it"),
    (["parallel.zero=1", "parallel.dp_group_size=4", "ft=[flashrecovery]"],
     "parallel.dp_group_size=4 is the whole DP dimension, one group"),
    (["parallel.zero=1", "parallel.dp_group_size=4", "ft=[flashrecovery,flash_ckpt]"], "only DeadPool's replicas"),
    (["parallel.dp_group_size=2"], "but parallel.zero=0 shards nothing: set parallel.zero=1 or "
                                   "parallel.dp_group_size=0"),
    ([*HSDP, "ft=[flashrecovery,deadpool]"], "remove deadpool from ft or set parallel.dp_group_size=0"),
    ([*HSDP, "ft=[flashrecovery,ndb]"], "parallel.zero=1 with ft=ndb: a neighbour taking over"),
])
def test_what_replica_groups_do_not_make_work_is_refused_with_the_reason(overrides, says):
    with pytest.raises(ConfigError) as refused:
        validate(_compose(*FOUR, *overrides))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_plan_divides_the_optimizer_shard_by_the_replica_group():
    whole, grouped = (make_plan(_compose(*FOUR, "parallel.zero=1", *extra)) for extra in ([], ["parallel."
                                                                                               "dp_group_size=2"]))
    assert grouped.memory.moments == pytest.approx(2 * whole.memory.moments)  # 1/2 of the state instead of 1/4
    assert grouped.memory.params == whole.memory.params and grouped.memory.grads == whole.memory.grads
    cfg = _compose(*FOUR, *HSDP)
    assert "zero=1 dp_group_size=2 (2 replica groups)" in make_plan(cfg).render(cfg)


def test_smoke_mode_keeps_replica_groups_that_train_and_drops_the_others():
    cfg = _compose(*FOUR, *HSDP, "ft=[flashrecovery]", "runner.smoke=true")
    apply_smoke(cfg)
    assert cfg.parallel.dp_group_size == 2
    cfg = _compose(*FOUR, "parallel.dp_group_size=2", "runner.smoke=true")
    changes = apply_smoke(cfg)
    assert cfg.parallel.dp_group_size == 0 and any(re.match(r"parallel.dp_group_size 2 -> 0", c) for c in changes)


def test_a_shard_is_lost_only_with_every_replica_group_that_holds_it():
    cfg = OmegaConf.create({"parallel": {"nodes": 2, "procs_per_node": 2, "zero": 1, "dp_group_size": 2}})
    assert shards_without_copy(cfg, ["flashrecovery"], [2]) == []  # rank 0 holds the same shard
    assert shards_without_copy(cfg, ["flashrecovery"], [2, 3]) == []  # a node: the other group holds both
    assert shards_without_copy(cfg, ["flashrecovery"], [0, 2]) == [0, 2]  # both copies of shard 0
    one = OmegaConf.create({"parallel": {"nodes": 2, "procs_per_node": 2, "zero": 1, "dp_group_size": 0}})
    assert shards_without_copy(one, ["flashrecovery"], [2]) == [2]


def test_losing_every_copy_of_a_shard_is_refused_at_config_time_naming_the_replica_groups():
    with pytest.raises(ConfigError) as refused:
        validate(_compose(*FOUR, *HSDP, "ft=[flashrecovery]", "fault=kill_rank", "fault.rank=0", "fault.step=5",
                          "+fault.extra=[{kind: kill_rank, rank: 2, step: 5}]"))
    assert "together with every copy (the same shard in the other DP replica groups)" in str(refused.value)
