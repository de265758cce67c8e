"""DeadPool with tensor and pipeline parallelism: a spare host takes every (dp, pp, tp) coordinate of a lost host,
each joiner's state comes from the DP replica at its (pp, tp) coordinate, and ZeRO-1 shards from the holder at that
coordinate (``Topology.replica_holder``).

The config checks run in process; the runs on real processes are in the slow tier, each compared with the
fault-free run of its layout (bit-identical parameters, exact sample accounting)."""

from __future__ import annotations

import re

import pytest

from runner.config import ConfigError
from runner.config.validate import trained_pp, trained_tp, validate
from tests.conftest import TP2PP2, TP2PP2_STEPS, run_cli  # and the fixture tp2pp2, the fault-free run
from tests.test_config import _compose
from tests.test_deadpool import assert_exact
from tests.test_zero_tp import CONSTANT_LR, STEPS, TP2, tp2_zero  # noqa: F401  (tp2_zero: the fixture)

TINY = "+recipe=gpt_tiny"
TP2_2X2 = ["parallel.nodes=2", "parallel.procs_per_node=2", "parallel.tp=2"]
PP2_2X2 = ["parallel.nodes=2", "parallel.procs_per_node=2", "parallel.pp=2"]
TP2PP2_2X4 = ["parallel.nodes=2", "parallel.procs_per_node=4", "parallel.tp=2", "parallel.pp=2"]


@pytest.mark.parametrize("layout", [TP2_2X2, PP2_2X2, TP2PP2_2X4, [*TP2_2X2, "parallel.zero=1"],
                                    [*TP2_2X2, "parallel.zero=1", "trainer.precision=bf16-true",
                                     "trainer.master_weights=true"]])
def test_deadpool_trains_at_tp_and_pp_and_smoke_mode_keeps_them(layout):
    cfg = _compose(TINY, "ft=[deadpool]", *layout)
    validate(cfg)
    assert (trained_tp(cfg), trained_pp(cfg)) == (cfg.parallel.tp, cfg.parallel.pp)


@pytest.mark.parametrize("overrides, says", [
    ([*TP2_2X2, "ft.deadpool.crash_action=swap"], "its tensor-parallel group would span two hosts"),
    (["parallel.nodes=2", "parallel.procs_per_node=2", "parallel.tp=2", "parallel.pp=2"],  # dp=1
     "some coordinate has no replica on another node"),
])
def test_what_deadpool_does_not_do_at_tp_and_pp_is_refused_with_the_reason(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        validate(_compose(TINY, "ft=[deadpool]", *overrides))


def test_zero1_replicas_that_cannot_leave_their_node_are_refused():
    # 2 nodes x 6 ranks at tp=2, dp=6: a replica per TP pair, three per node, so three replicas on is the other node
    validate(_compose(TINY, "ft=[deadpool]", "parallel.nodes=2", "parallel.procs_per_node=6", "parallel.tp=2",
                      "trainer.global_batch_size=12", "parallel.zero=1"))
    # tp*pp=4 on nodes of 6: replica 1 straddles both nodes, and no shift puts every replica on another node
    cfg = _compose(TINY, "ft=[deadpool]", "parallel.nodes=2", "parallel.procs_per_node=6", "parallel.tp=2",
                   "parallel.pp=2", "trainer.global_batch_size=12", "parallel.zero=1")
    with pytest.raises(ConfigError, match="no shift of the replicas puts every replica on another node"):
        validate(cfg)


@pytest.mark.slow
def test_tp2_pp2_node_loss_is_taken_by_a_spare_host_exactly(tp2pp2, run_dir):
    run = run_cli(*TP2PP2, f"trainer.max_steps={TP2PP2_STEPS}", "ft=[deadpool]", "fault=kill_node", "fault.node=1",
                  "fault.step=5", run_dir=run_dir)
    assert_exact(run, tp2pp2.summary)
    rec = run.only_recovery()
    assert (rec["fault"], rec["action"], rec["rpo_steps"]) == ("node_loss", "swap_spare", 0)
    assert rec["victims"] == [4, 5, 6, 7]
    assigned = run.events("spare_assigned")
    assert sorted(e["logical"] for e in assigned) == [4, 5, 6, 7] and {e["node"] for e in assigned} == {2}
    # every joiner's slice comes from replica 0 at its own (pp, tp) coordinate: rank r - 4 serves rank r
    assert sorted(e["rank"] for e in run.events("state_sent")) == [0, 1, 2, 3]
    assert sorted(e["rank"] for e in run.events("state_restored")) == [4, 5, 6, 7]


@pytest.fixture(scope="module")
def pp2_zero(tmp_path_factory):
    """The fault-free run at pp=2, dp=2 with ZeRO-1 on 2 nodes x 2 ranks."""
    run = run_cli(TINY, *PP2_2X2, "parallel.zero=1", CONSTANT_LR, f"trainer.max_steps={STEPS}",
                  run_dir=tmp_path_factory.mktemp("pp2z") / "run")
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


# (layout, its fault-free fixture): rank (dp 1, c) is held by rank (dp 0, c) at the same tp or pp coordinate c
ZERO1_LAYOUTS = {"tp2": ([*TP2, "parallel.zero=1"], "tp2_zero"),
                 "pp2": ([TINY, *PP2_2X2, "parallel.zero=1"], "pp2_zero")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(ZERO1_LAYOUTS))
def test_zero1_node_loss_shards_come_from_the_holder_at_the_same_coordinate(layout, request, run_dir):
    overrides, fault_free = ZERO1_LAYOUTS[layout]
    run = run_cli(*overrides, CONSTANT_LR, f"trainer.max_steps={STEPS}", "ft=[deadpool]",
                  "fault=kill_node", "fault.node=1", "fault.step=6", run_dir=run_dir)
    assert_exact(run, request.getfixturevalue(fault_free).summary)
    rec = run.only_recovery()
    assert (rec["action"], rec["victims"]) == ("swap_spare", [2, 3]) and rec["rpo_steps"] <= 1
    restored = {e["rank"]: e for e in run.events("shard_restored")}
    assert {r: e["holder"] for r, e in restored.items()} == {2: 0, 3: 1}


@pytest.mark.slow
def test_tp2_zero1_kill_during_replication_replays_the_shard_of_its_dp_coordinate(tp2_zero, run_dir):  # noqa: F811
    # rank 3 is (dp 1, tp 1): its holder, rank 1, replays update 7 on the shard of DP coordinate 1 of TP slice 1
    run = run_cli(*TP2, "parallel.zero=1", CONSTANT_LR, f"trainer.max_steps={STEPS}", "ft=[deadpool]",
                  "fault=kill_rank", "fault.rank=3", "fault.step=6", "fault.during=replication",
                  "ft.deadpool.replication=copy", run_dir=run_dir)
    assert_exact(run, tp2_zero.summary)
    (restored,) = run.events("shard_restored")
    assert (restored["rank"], restored["holder"], restored["replayed_updates"]) == (3, 1, 1)
