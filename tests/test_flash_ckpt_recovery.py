"""ft=flash_ckpt on real processes: every rank restarts from the newest snapshot all of them hold,
from memory, a partner node's copy or disk; a corrupt snapshot is refused; /dev/shm is left clean,
also when it is too small for the snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.recovery.flash_ckpt.disk import read_verified
from runner.recovery.flash_ckpt.shm import FREE_BYTES_ENV, job_files
from runner.recovery.flash_names import flash_job_id
from tests.conftest import ONE_BY_TWO, TWO_BY_TWO, run_cli

FLASH = ["ft=[flash_ckpt]", "ft.flash_ckpt.every_n_steps=5"]
TWO, FOUR = [*ONE_BY_TWO, *FLASH], [*TWO_BY_TWO, *FLASH]  # the layouts and length of the shared fault-free runs


@pytest.fixture(scope="module")
def fault_free(one_by_two, two_by_two):
    """Fault-free references of the same length, the shared runs of tests/conftest.py (snapshots do not change the
    training): 2 ranks on one node, 4 ranks on two nodes."""
    for run in (one_by_two, two_by_two):
        assert run.summary["status"] == "completed", run.output[-3000:]
    return {2: one_by_two.summary, 4: two_by_two.summary}


def assert_restarted(run, reference, resumed_at: int, fault_step: int = 23) -> dict:
    """Completed, bit-identical to the fault-free run, resumed from the snapshots of `resumed_at`, /dev/shm clean."""
    s = assert_restarted_exactly(run, reference, resumed_at, fault_step)
    restored = run.events("snapshot_restored")
    assert len(restored) == s["world_size"] and {e["step"] for e in restored} == {resumed_at}
    return {e["rank"]: e for e in restored}


def assert_restarted_exactly(run, reference, resumed_at: int, fault_step: int) -> dict:
    """Completed, every rank restarted at `resumed_at`, bit-identical to the fault-free run, /dev/shm clean: the
    summary."""
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert not job_files(flash_job_id(run.dir)), "shared-memory segments of the job left behind"
    assert s["global_step"] == reference["global_step"]
    assert s["param_checksum"] == reference["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == reference["samples_committed"]
    assert s["steps_redone"] == fault_step - resumed_at
    rec = run.only_recovery()
    assert rec["action"] == "restart_all" and rec["step"] == fault_step
    assert rec["rpo_steps"] == fault_step - resumed_at
    assert rec["rto_s"] > 0
    assert [e["role"] for e in run.events("worker_started")].count("restore") == s["world_size"]
    return s


@pytest.mark.slow
def test_zero1_shards_each_restore_from_their_own_snapshot_exactly(fault_free, run_dir):
    # ZeRO-1: each snapshot holds its rank's optimizer shard; after the restore every rank syncs the parameters
    run = run_cli(*FOUR, "parallel.zero=1", "fault=kill_all", "fault.step=23", run_dir=run_dir)
    restored = assert_restarted(run, fault_free[4], resumed_at=20)
    assert sorted(restored) == [0, 1, 2, 3]


def test_kill_all_resumes_from_memory_exactly(fault_free, run_dir):
    # no decide window: the decision follows the first exit, before the other rank's exit is seen
    run = run_cli(*TWO, "ft.flash_ckpt.persist_every_n_steps=50", "fault=kill_all", "fault.step=23",
                  "heartbeat.decide_window_s=0", run_dir=run_dir)
    restored = assert_restarted(run, fault_free[2], resumed_at=20)
    assert {e["source"] for e in restored.values()} == {"memory"}
    assert run.summary["recoveries"][0]["victims"] == [0, 1]  # every rank the fault killed
    # the node's persister saw both trainers die and wrote their newest snapshot (persist at breakpoint)
    persisted = run.events("snapshot_breakpoint_persisted")
    assert sorted((e["snapshot_rank"], e["snapshot_step"]) for e in persisted) == [(0, 20), (1, 20)]
    for e in persisted:
        assert read_verified(Path(e["path"]))["global_step"] == 20
    assert "restart_all" in run.output  # the decision is shown live


def test_a_fault_before_the_first_snapshot_restarts_every_rank_from_step_0_exactly(fault_free, run_dir):
    # nothing to restore yet (the first snapshot is step 5's): the ranks agree to start where the run did
    run = run_cli(*TWO, "fault=kill_all", "fault.step=3", "heartbeat.decide_window_s=0", run_dir=run_dir)
    assert_restarted_exactly(run, fault_free[2], resumed_at=0, fault_step=3)
    assert not run.events("snapshot_restored")
    (start,) = run.events("restart_from_start")
    assert (start["rank"], start["resume"]) == (0, None)


def test_a_node_lost_with_the_only_copy_of_the_first_snapshot_restarts_every_rank_from_step_0_exactly(fault_free,
                                                                                                      run_dir):
    # no partner copies and nothing persisted: node 1's ranks come back holding nothing and node 0's hold step 5's
    # snapshot alone, as when a fault strikes while the first snapshot is committed on some ranks only
    no_copy = ["ft.flash_ckpt.neighbour_backup=false", "ft.flash_ckpt.persist_every_n_steps=0"]
    run = run_cli(*FOUR, *no_copy, "fault=kill_node", "fault.node=1", "fault.step=7", run_dir=run_dir)
    assert_restarted_exactly(run, fault_free[4], resumed_at=0, fault_step=7)
    assert not run.events("snapshot_restored")
    (start,) = run.events("restart_from_start")
    assert "only the first snapshot (step 5) was held, and rank(s) [2, 3] held none" in start["reason"]


@pytest.mark.slow
def test_a_node_lost_with_the_only_copies_of_later_snapshots_fails_with_what_each_rank_held(run_dir):
    # node 0's ranks hold steps 5 and 10, node 1's nothing: starting over would throw away more than the fault did
    run = run_cli(*FOUR, "ft.flash_ckpt.neighbour_backup=false", "ft.flash_ckpt.persist_every_n_steps=0",
                  "fault=kill_node", "fault.node=1", "fault.step=12", run_dir=run_dir)
    assert run.returncode == 1 and run.summary["status"] == "failed"
    assert "steps per rank: [[10, 5], [10, 5], [], []]" in run.summary["error"]
    assert "ft.flash_ckpt.persist_every_n_steps" in run.summary["error"]
    assert not job_files(flash_job_id(run.dir)), "shared-memory segments of the job left behind"


@pytest.mark.slow
def test_node_loss_restores_the_lost_ranks_from_the_partner_nodes_memory(fault_free, run_dir):
    run = run_cli(*FOUR, "fault=kill_node", "fault.node=1", "fault.step=23", run_dir=run_dir)
    restored = assert_restarted(run, fault_free[4], resumed_at=20)
    assert {r: e["source"] for r, e in restored.items()} == {0: "memory", 1: "memory", 2: "partner", 3: "partner"}
    assert run.summary["recoveries"][0]["fault"] == "node_loss"
    moved = [e for e in run.events("worker_started") if e["role"] == "restore" and e["rank"] in (2, 3)]
    assert {e["node"] for e in moved} == {0}  # the lost node's ranks restart on its partner


@pytest.mark.slow
def test_whole_host_loss_restores_from_disk(fault_free, run_dir):
    run = run_cli(*FOUR, "ft.flash_ckpt.persist_every_n_steps=10", "fault=wipe_shm", "fault.step=23", run_dir=run_dir)
    # every rank restores the newest step on disk. The node persisters finish the writes in flight (step 20's, asked
    # for in step 21) before the restart lists the files, so that is step 20, unless a persister had not yet copied
    # a rank's step-20 slot out when the memory went: that persist's failure is logged, and step 10 is restored
    missed = [e for e in run.events("snapshot_persist_unreported") if e["snapshot_step"] == 20 and not e["ok"]]
    restored = assert_restarted(run, fault_free[4], resumed_at=10 if missed else 20)
    assert {e["source"] for e in restored.values()} == {"disk"}
    assert run.summary["recoveries"][0]["victims"] == [0, 1, 2, 3]
    assert run.events("fault_injected")[0]["segments_lost"] > 0


@pytest.mark.slow
def test_a_corrupt_snapshot_is_refused_and_the_previous_one_used(fault_free, run_dir):
    # memory only: a breakpoint persist could save step 20 before the byte flips and serve it from disk
    run = run_cli(*TWO, "ft.flash_ckpt.persist_every_n_steps=0", "fault=corrupt_snapshot", "fault.rank=1",
                  "fault.step=23", run_dir=run_dir)
    # one node: no partner copy of step 20, so both ranks agree on 15; the resume is still exact
    restored = assert_restarted(run, fault_free[2], resumed_at=15)
    (skipped,) = run.events("snapshot_skipped")
    assert (skipped["rank"], skipped["step"], skipped["source"]) == (1, 20, "memory")
    assert "checksum mismatch" in skipped["reason"]
    assert all(e["refused"] == [20] and e["invalidated"] == [20] for e in restored.values())


@pytest.mark.slow
def test_without_flash_ckpt_kill_all_fails_with_the_reason(run_dir):
    run = run_cli("+recipe=gpt_tiny", "trainer.max_steps=20", "ft=[flashrecovery]", "fault=kill_all", "fault.step=5",
                  "policy.reject_unhandled=false", run_dir=run_dir)  # the config check would refuse it
    assert run.returncode == 1 and run.summary["status"] == "failed"
    assert "ft=flash_ckpt" in run.summary["error"]


@pytest.mark.slow
def test_a_too_small_dev_shm_fails_the_run_with_one_paragraph_and_leaves_nothing(run_dir, monkeypatch):
    monkeypatch.setenv(FREE_BYTES_ENV, str(256 * 1024))  # what the size check sees, inherited by every worker
    run = run_cli(*TWO, run_dir=run_dir)
    assert run.returncode == 1 and run.summary["status"] == "failed"
    error = run.summary["error"]
    assert "ShmSpaceError" in error and f"{FREE_BYTES_ENV}=262144" in error and "--shm-size" in error
    assert "\n" not in error
    assert run.summary["global_step"] <= 6  # the first snapshot (step 5, awaited in step 6) found out
    assert not job_files(flash_job_id(run.dir))
