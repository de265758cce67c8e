"""DeadPool hot spares on real processes: a lost node's ranks are swapped for warm spares."""

from __future__ import annotations

import pytest

from runner.recovery.deadpool.action import pick_spares
from tests.conftest import TWO_BY_TWO, run_cli

# the shared fault-free run's layout and length (tests/conftest.py) with a spare node of 2 ranks
FOUR = [*TWO_BY_TWO, "parallel.spares=2", "ft=[deadpool]"]
SIX = ["+recipe=gpt_tiny", "parallel.nodes=3", "parallel.procs_per_node=2", "parallel.spares=2", "ft=[deadpool]",
       "trainer.global_batch_size=12", "trainer.max_steps=30"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """The fault-free run of SIX, the reference of the ZeRO-1 runs."""
    run = run_cli(*SIX, run_dir=tmp_path_factory.mktemp("ff") / "run")
    assert run.summary["status"] == "completed", run.output[-3000:]
    return run.summary


def test_node_loss_is_replaced_by_warm_spares_exactly(two_by_two, run_dir):
    run = run_cli(*FOUR, "fault=kill_node", "fault.node=1", "fault.step=12", run_dir=run_dir)
    assert_exact(run, two_by_two.summary)
    rec = run.only_recovery()
    assert (rec["fault"], rec["action"], rec["victims"], rec["rpo_steps"]) == ("node_loss", "swap_spare", [2, 3], 0)
    assert len(run.events("worker_started")) == 6  # 4 ranks + 2 spares started with the job, nothing after
    assert sorted(e["logical"] for e in run.events("spare_assigned")) == [2, 3]
    assert {e["node"] for e in run.events("spare_assigned")} == {2}  # spares live on a node of their own


@pytest.mark.parametrize("mode", ["replay", pytest.param("copy", marks=pytest.mark.slow)])
def test_zero1_host_loss_then_a_worker_kill_take_their_shards_from_the_replicas_exactly(two_by_two, run_dir, mode):
    # node 1 is lost at step 12: the spares take ranks 2 and 3 with the shards rank 0 and 1 held; at step 20 rank 0
    # is killed and restarted in place with the shard rank 2, now on the spare host, holds since the first recovery
    run = run_cli(*FOUR, "parallel.zero=1", f"ft.deadpool.replication={mode}", "fault=kill_node", "fault.node=1",
                  "fault.step=12", "+fault.extra=[{kind: kill_rank, rank: 0, step: 20}]", run_dir=run_dir)
    s = assert_exact(run, two_by_two.summary)  # ZeRO-1 makes the very updates the replicated optimizer does
    assert [(r["action"], r["victims"]) for r in s["recoveries"]] == [("swap_spare", [2, 3]), ("restart_rank", [0])]
    restored = sorted((e["rank"], e["holder"]) for e in run.events("shard_restored"))
    assert restored == [(0, 2), (2, 0), (3, 1)]
    assert not run.events("replication_failed") and not run.events("replica_drift")
    if mode == "replay":  # seeds only: at the start and after each recovery, nothing per step
        assert s["replication_bytes_per_step"] == 0 and 0 < s["replication_bytes_sent"]
    else:
        assert s["replication_bytes_per_step"] > 0


@pytest.mark.slow
def test_no_spare_left_fails_clearly(run_dir):
    run = run_cli(*SIX[:3], "parallel.spares=1", "ft=[deadpool]", "trainer.global_batch_size=12",
                  "trainer.max_steps=30", "fault=kill_node", "fault.node=1", "fault.step=8",
                  "policy.reject_unhandled=false", run_dir=run_dir)  # the config check would refuse it
    s = run.summary
    assert run.returncode == 1 and s["status"] == "failed"
    assert "node(s) [1] lost" in s["error"] and "only 1 ready spare" in s["error"]


@pytest.mark.slow
def test_no_spare_left_falls_through_to_ndb(run_dir):
    run = run_cli(*SIX[:3], "parallel.spares=1", "ft=[deadpool,ndb]", "trainer.global_batch_size=12",
                  "trainer.max_steps=30", "fault=kill_node", "fault.node=1", "fault.step=8", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    assert s["recoveries"][0]["action"] == "takeover" and s["samples_lost"] == 0


def test_a_lost_hosts_ranks_go_together_to_one_spare_host():
    # spare hosts 2 and 3 (wids 10-13); host 2 has one ready spare left: host 1's two ranks go to host 3
    assert pick_spares([(4, 1), (5, 1)], [(10, 2), (12, 3), (13, 3)]) == [12, 13]
    # two lost hosts, two spare hosts of two: each lost host's ranks on one spare host, in slot order
    assert pick_spares([(0, 0), (1, 0), (2, 1), (3, 1)], [(8, 2), (9, 2), (10, 3), (11, 3)]) == [8, 9, 10, 11]
    # ranks of different hosts (crashes) take the pool's spares in order; no host fits: the next spares in order
    assert pick_spares([(1, 0), (3, 1)], [(8, 2), (9, 2)]) == [8, 9]
    assert pick_spares([(2, 1), (3, 1)], [(8, 2), (10, 3)]) == [8, 10]


def test_spares_without_deadpool_are_refused(run_dir):
    run = run_cli("+recipe=gpt_tiny", "parallel.spares=1", run_dir=run_dir, timeout=60)
    assert run.returncode == 2 and "ft=deadpool" in run.output


# -- ZeRO-1: sharded optimizer state, replicated to a neighbour on another node every step ---------
ZERO = [*SIX, "parallel.zero=1"]


def assert_exact(run, fault_free) -> dict:
    """Completed with the fault-free run's parameters and sample accounting; returns the summary."""
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["param_checksum"] == fault_free["param_checksum"]
    accounting = (s["samples_lost"], s["samples_duplicated"], s["samples_committed"])
    assert accounting == (0, 0, fault_free["samples_committed"])
    return s


MODES = ["replay", "copy"]  # ft.deadpool.replication


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_zero1_with_replication_trains_exactly_like_replicated_state(fault_free, run_dir, mode):
    verify = ["ft.deadpool.verify_every_n_steps=7"] if mode == "replay" else []  # 4 verifications in 30 steps
    run = run_cli(*ZERO, f"ft.deadpool.replication={mode}", *verify, run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    assert s["param_checksum"] == fault_free["param_checksum"]  # same update math, shard by shard
    assert s["replication_buffer_bytes_max"] > 0 and s["replication_bytes_sent"] > 0
    assert (s["replication_bytes_per_step"] > 0) == (mode == "copy")  # replay: the holders replay every update
    assert not run.events("replication_failed") and not run.events("replica_drift")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_zero1_node_loss_spares_get_their_shards_from_the_neighbour_replicas(fault_free, run_dir, mode):
    run = run_cli(*ZERO, f"ft.deadpool.replication={mode}", "fault=kill_node", "fault.node=1", "fault.step=20",
                  run_dir=run_dir)
    assert_exact(run, fault_free)
    rec = run.only_recovery()
    assert (rec["action"], rec["victims"]) == ("swap_spare", [2, 3]) and rec["rpo_steps"] <= 1
    restored = {e["rank"]: e for e in run.events("shard_restored")}
    assert sorted(restored) == [2, 3]
    assert {r: e["holder"] for r, e in restored.items()} == {2: 4, 3: 5}  # the replicas on the next node


@pytest.mark.slow
def test_zero1_kill_during_an_in_flight_replication_replays_the_previous_generation(fault_free, run_dir):
    run = run_cli(*ZERO, "ft.deadpool.replication=copy", "fault=kill_rank", "fault.rank=2", "fault.step=20",
                  "fault.during=replication", run_dir=run_dir)
    assert_exact(run, fault_free)
    (restored,) = run.events("shard_restored")
    # the copy of update 21 was cut half-way: update 20's replica plus a replay of update 21
    assert (restored["rank"], restored["step"], restored["replayed_updates"]) == (2, 21, 1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_zero1_laggard_finishes_its_update_from_the_peers_gradients(fault_free, run_dir, mode):
    run = run_cli(*ZERO, f"ft.deadpool.replication={mode}", "fault=transient", "fault.rank=1", "fault.step=12",
                  "fault.during=after_reduce", run_dir=run_dir)
    s = assert_exact(run, fault_free)
    (finished,) = run.events("shard_update_finished")
    assert (finished["rank"], finished["step"]) == (1, 13)
    assert s["recoveries"][0]["action"] == "retry" and s["recoveries"][0]["rpo_steps"] == 0


# step 12: a kill at a snapshot step races the copy it starts; at 12 step 10's is committed on every rank
OWNER_AND_HOLDER = ["fault=kill_rank", "fault.rank=2", "fault.step=12",
                    "+fault.extra=[{kind: kill_rank, rank: 4, step: 12}]"]


def test_zero1_owner_and_replica_lost_together_is_refused_at_config_time_without_flash_ckpt(run_dir):
    run = run_cli(*ZERO, *OWNER_AND_HOLDER, run_dir=run_dir, timeout=60)
    assert run.returncode == 2
    assert "took the ZeRO-1 optimizer shard(s) of rank(s) [2] together with their only copy" in run.output


@pytest.mark.slow
def test_zero1_owner_and_replica_lost_together_fails_clearly_at_run_time(run_dir):
    run = run_cli(*ZERO, *OWNER_AND_HOLDER, "policy.reject_unhandled=false", run_dir=run_dir)
    s = run.summary
    assert run.returncode == 1 and s["status"] == "failed"
    assert "took the ZeRO-1 optimizer shard(s) of rank(s) [2] together with their only copy" in s["error"]
    assert "add ft=flash_ckpt" in s["error"]


@pytest.mark.slow
def test_zero1_owner_and_replica_lost_together_restart_every_rank_from_snapshots(fault_free, run_dir):
    run = run_cli(*ZERO, "ft=[deadpool,flash_ckpt]", "ft.flash_ckpt.every_n_steps=5", *OWNER_AND_HOLDER,
                  run_dir=run_dir)
    assert_exact(run, fault_free)
    rec = run.only_recovery()
    assert (rec["action"], rec["victims"], rec["rpo_steps"]) == ("restart_all", [2, 4], 2)
    assert {e["step"] for e in run.events("snapshot_restored")} == {10}
