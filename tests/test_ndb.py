"""NDB on real processes: a neighbour takes over a killed rank's micro-batch; nobody restarts."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

STEPS = 30
FOUR = ["+recipe=gpt_tiny", f"trainer.max_steps={STEPS}"]  # on 4 ranks, as long as the shared fault-free run


@pytest.fixture(scope="module")
def fault_free(two_by_two):
    """The fault-free run of 4 data-parallel ranks (on 2 nodes x 2 ranks, shared: tests/conftest.py; neither the
    layout of the same ranks nor NDB changes a fault-free run's training)."""
    assert two_by_two.summary["status"] == "completed", two_by_two.output[-3000:]
    return two_by_two.summary


def assert_takeover_run(run, fault_free, victims):
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert len(run.events("worker_started")) == 4  # no process restarted
    assert s["global_step"] == fault_free["global_step"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == fault_free["samples_committed"]  # the global batch is unchanged
    assert all(m["counts"] == [1, 1, 1, 1] for m in run.metrics())
    rec = s["recoveries"][0]
    assert rec["action"] == "takeover" and rec["victims"] == victims and rec["rpo_steps"] == 0
    drift = abs(s["final_loss"] - fault_free["final_loss"]) / fault_free["final_loss"]
    print(f"final loss {s['final_loss']:.4f} vs fault-free {fault_free['final_loss']:.4f}: {100 * drift:.2f}%")
    assert drift < 0.01
    return s


def test_kill_rank_neighbour_does_both(fault_free, run_dir):
    run = run_cli(*FOUR, "parallel.nodes=4", "parallel.procs_per_node=1", "ft=[ndb]", "fault=kill_rank",
                  "fault.rank=2", "fault.step=15", run_dir=run_dir)
    s = assert_takeover_run(run, fault_free, victims=[2])
    (takeover,) = s["takeovers"]
    assert takeover["extra_ranks"] == [2] and takeover["steps_taken_over"] == STEPS - 15
    assert takeover["step_time_after_s"] > 0 and takeover["peak_rss_after_kib"] >= takeover["peak_rss_before_kib"]


@pytest.mark.slow
def test_node_loss_is_spread_over_distinct_neighbours(fault_free, run_dir):
    run = run_cli(*FOUR, "parallel.nodes=2", "parallel.procs_per_node=2", "ft=[ndb]", "fault=kill_node",
                  "fault.node=1", "fault.step=10", run_dir=run_dir)
    s = assert_takeover_run(run, fault_free, victims=[2, 3])
    assert s["recoveries"][0]["fault"] == "node_loss"
    assert sorted(t["extra_ranks"] for t in s["takeovers"]) == [[2], [3]]


def test_ndb_refuses_a_module_it_cannot_approximate(run_dir):
    run = run_cli("+recipe=gpt_tiny", "ft=[ndb]", "model._target_=lightning.pytorch.demos.boring_classes.BoringModel",
                  run_dir=run_dir, timeout=60)
    assert run.returncode == 2 and "ft=ndb" in run.output


@pytest.mark.slow
def test_a_repaired_rank_rejoins_from_a_peer_and_the_takeover_ends(fault_free, run_dir):
    run = run_cli(*FOUR, "parallel.nodes=4", "parallel.procs_per_node=1", "ft=[ndb]", "ft.ndb.repair_after_s=0",
                  "fault=kill_rank", "fault.rank=1", "fault.step=8", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert [e["logical"] for e in run.events("rejoined")] == [1]
    assert [e["role"] for e in run.events("state_restored")] == ["joiner"]
    accounting = (s["samples_lost"], s["samples_duplicated"], s["samples_committed"])
    assert accounting == (0, 0, fault_free["samples_committed"])
    assert s["param_checksum"]  # every replica, the rejoined one included, ends bit-identical
    (takeover,) = s["takeovers"]
    assert takeover["extra_ranks"] == [1] and 0 < takeover["steps_taken_over"] < STEPS - 8
