"""DeadPool hot spares on real processes: a lost node's ranks are swapped for warm spares."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

SIX = ["+recipe=gpt_tiny", "parallel.nodes=3", "parallel.procs_per_node=2", "parallel.spares=2", "ft=[deadpool]",
       "trainer.global_batch_size=12", "trainer.max_steps=30"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    run = run_cli(*SIX, run_dir=tmp_path_factory.mktemp("ff") / "run")
    assert run.summary["status"] == "completed", run.output[-3000:]
    return run.summary


def test_node_loss_is_replaced_by_warm_spares_exactly(fault_free, run_dir):
    run = run_cli(*SIX, "fault=kill_node", "fault.node=1", "fault.step=12", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["param_checksum"] == fault_free["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_committed"]) == (0, 0, fault_free["samples_committed"])
    (rec,) = s["recoveries"]
    assert (rec["fault"], rec["action"], rec["victims"], rec["rpo_steps"]) == ("node_loss", "swap_spare", [2, 3], 0)
    assert len(run.events("worker_started")) == 8  # 6 ranks + 2 spares started with the job, nothing after
    assert sorted(e["logical"] for e in run.events("spare_assigned")) == [2, 3]
    assert {e["node"] for e in run.events("spare_assigned")} == {3}  # spares live on a node of their own


def test_no_spare_left_fails_clearly(run_dir):
    run = run_cli(*SIX[:3], "parallel.spares=1", "ft=[deadpool]", "trainer.global_batch_size=12",
                  "trainer.max_steps=30", "fault=kill_node", "fault.node=1", "fault.step=8",
                  "policy.reject_unhandled=false", run_dir=run_dir)  # the config check would refuse it
    s = run.summary
    assert run.returncode == 1 and s["status"] == "failed"
    assert "node(s) [1] lost" in s["error"] and "only 1 ready spare" in s["error"]


def test_no_spare_left_falls_through_to_ndb(run_dir):
    run = run_cli(*SIX[:3], "parallel.spares=1", "ft=[deadpool,ndb]", "trainer.global_batch_size=12",
                  "trainer.max_steps=30", "fault=kill_node", "fault.node=1", "fault.step=8", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    assert s["recoveries"][0]["action"] == "takeover" and s["samples_lost"] == 0


def test_spares_without_deadpool_are_refused(run_dir):
    run = run_cli("+recipe=gpt_tiny", "parallel.spares=1", run_dir=run_dir, timeout=60)
    assert run.returncode == 2 and "ft=deadpool" in run.output
