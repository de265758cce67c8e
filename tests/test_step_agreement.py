"""A step's agreement (tp*pp > 1) that completes on one model slice and fails on another.

The faults hold the split deterministically (``during: agreement``, docs/faults.md): at tp = 2, dp = 2 on 2 nodes,
step 5's agreement completes on every rank; rank 3 (model slice 1 of replica 1) is then killed before it commits,
and rank 1 (slice 1 of replica 0) has its agreement fail. Ranks 0 and 2 committed step 5; no live rank holds slice 1
at step 5, so rank 1 rolls the step forward from its own reduced gradients and the full model's gradient norm of
rank 0, then serves slice 1 to rank 3's replacement, which finishes the step it restored without compute. Every step
clips (by the full model's norm), so the handed-over norm is exercised; the run must end bit-identical to its
fault-free run with every sample counted once. Under ZeRO-1 (with DeadPool, whose replica of rank 3's shard rank 1
holds) rank 1 rolls its own shard forward, and rank 3's replacement gets its shard with that step's update replayed.
In the slow tier node 1 dies there instead, and DeadPool's spare host takes it.
"""

from __future__ import annotations

import re

import pytest

from runner.config import ConfigError
from runner.config.validate import validate
from tests.conftest import CLIPPED_TINY, run_cli
from tests.test_config import _compose

STEPS = 10
TP2 = [*CLIPPED_TINY, "parallel.procs_per_node=2", "parallel.tp=2", f"trainer.max_steps={STEPS}"]
FAILED_AGREEMENT = "{kind: transient, rank: 1, step: 5, during: agreement}"  # rank 1's agreement fails at step 5
ZERO1 = [*TP2, "parallel.zero=1"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    ref = run_cli(*TP2, "ft=[flashrecovery]", run_dir=tmp_path_factory.mktemp("tp2") / "run")
    assert ref.summary["status"] == "completed", ref.output[-4000:]
    return ref


@pytest.fixture(scope="module")
def zero1_fault_free(tmp_path_factory):
    ref = run_cli(*ZERO1, "ft=[flashrecovery,deadpool]", run_dir=tmp_path_factory.mktemp("tp2_zero1") / "run")
    assert ref.summary["status"] == "completed", ref.output[-4000:]
    return ref


def assert_exact(run, ref) -> None:
    """Bit-identical to the fault-free run, the same loss at every step, every sample counted once."""
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["global_step"] == STEPS and s["param_checksum"] == ref.summary["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == ref.summary["samples_committed"]
    assert [m["loss"] for m in run.metrics()] == [m["loss"] for m in ref.metrics()]


def test_an_agreement_split_between_model_slices_rolls_the_missing_slice_forward(fault_free, run_dir):
    run = run_cli(*TP2, "ft=[flashrecovery]", "fault=kill_rank", "fault.rank=3", "fault.step=5",
                  "fault.during=agreement", f"+fault.extra=[{FAILED_AGREEMENT}]", run_dir=run_dir)
    assert_exact(run, fault_free)
    rolled = run.events("step_rolled_forward")
    assert [(e["rank"], e["step"], e["norm_from"]) for e in rolled] == [(1, 5, 0)]
    # slice 1 at step 6 was on rank 1 alone once it rolled forward: it serves rank 3's replacement
    assert [e["rank"] for e in run.events("state_sent")] == [1]
    assert [(e["rank"], e["role"]) for e in run.events("state_restored")] == [(3, "joiner")]


def test_under_zero1_the_member_whose_agreement_failed_rolls_its_own_shard_forward(zero1_fault_free, run_dir):
    # the same split under ZeRO-1: rank 1 updates its own shard of slice 1 with the full model's norm from rank 0,
    # records the update for the replica of rank 3's shard it holds (DeadPool), and rank 3's replacement gets that
    # shard with the update replayed, then slice 1's Lightning state from rank 1
    run = run_cli(*ZERO1, "ft=[flashrecovery,deadpool]", "fault=kill_rank", "fault.rank=3", "fault.step=5",
                  "fault.during=agreement", f"+fault.extra=[{FAILED_AGREEMENT}]", run_dir=run_dir)
    assert_exact(run, zero1_fault_free)
    assert [(e["rank"], e["step"], e["norm_from"]) for e in run.events("step_rolled_forward")] == [(1, 5, 0)]
    assert [(e["rank"], e["holder"], e["replayed_updates"]) for e in run.events("shard_restored")] == [(3, 1, 1)]
    assert [e["rank"] for e in run.events("state_sent")] == [1]


@pytest.mark.slow
def test_a_host_lost_inside_the_agreement_is_replaced_by_the_spare_host_exactly(fault_free, run_dir):
    # node 1 (ranks 2 and 3) dies inside step 5's agreement, which completed on rank 0 and failed on rank 1: the
    # tp2 layout of tests/test_torchrun_per_host.py's lost host, held deterministically
    run = run_cli(*TP2, "ft=[deadpool]", "fault=kill_node", "fault.node=1", "fault.step=5",
                  "fault.during=agreement", f"+fault.extra=[{FAILED_AGREEMENT}]", run_dir=run_dir)
    assert_exact(run, fault_free)
    assert [(e["rank"], e["step"]) for e in run.events("step_rolled_forward")] == [(1, 5)]
    assert sorted(e["rank"] for e in run.events("state_sent")) == [0, 1]  # each slice to the spare's rank there
    assert sorted(e["rank"] for e in run.events("state_restored")) == [2, 3]


@pytest.mark.slow
def test_under_zero1_a_host_lost_inside_the_agreement_is_replaced_by_the_spare_host_exactly(zero1_fault_free,
                                                                                             run_dir):
    # node 1 dies inside step 5's agreement under ZeRO-1, with DeadPool copying whole shards: the spare host's rank 3
    # gets its shard from rank 1's replica plus rank 1's rolled-forward update, its rank 2 from rank 0's replica (with
    # step 5's update replayed or not: only the node's announcing rank is held, so rank 2 may have committed the step
    # and sent its copy before the node went)
    run = run_cli(*ZERO1, "ft=[deadpool]", "ft.deadpool.replication=copy", "fault=kill_node", "fault.node=1",
                  "fault.step=5", "fault.during=agreement", f"+fault.extra=[{FAILED_AGREEMENT}]", run_dir=run_dir)
    assert_exact(run, zero1_fault_free)
    assert [(e["rank"], e["step"]) for e in run.events("step_rolled_forward")] == [(1, 5)]
    restored = {e["rank"]: (e["holder"], e["replayed_updates"]) for e in run.events("shard_restored")}
    assert sorted(restored) == [2, 3] and restored[3] == (1, 1) and restored[2][0] == 0
    assert sorted(e["rank"] for e in run.events("state_sent")) == [0, 1]  # each slice to the spare's rank there


@pytest.mark.parametrize("overrides, says", [
    (["parallel.procs_per_node=1", "fault=transient", "fault.during=agreement", "fault.step=3"],
     "needs parallel.tp or parallel.pp above 1"),
    (["parallel.procs_per_node=2", "parallel.tp=2", "fault=hang_rank", "fault.during=agreement", "fault.step=3"],
     "kind transient, kill_rank or kill_node (not hang_rank)"),
    (["parallel.procs_per_node=2", "parallel.tp=2", "fault=kill_rank", "fault.during=agreement",
      "fault.step=-1", "fault.after_s=3"], "a fault.step"),
])
def test_a_fault_in_the_agreement_where_none_can_strike_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        validate(_compose("+recipe=gpt_tiny", "parallel.nodes=2", "ft=[flashrecovery]", *overrides))
