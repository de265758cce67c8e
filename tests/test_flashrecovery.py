"""FlashRecovery on real processes: SIGKILL/SIGSTOP/transient faults, exact state afterwards."""

from __future__ import annotations

import statistics

import pytest

from tests.conftest import TWO_BY_TWO, run_cli
from tests.test_diagnosis import assert_diagnosed

FOUR = TWO_BY_TWO  # 2 nodes x 2 ranks, 30 steps: the layout of the shared fault-free run
FR = ["ft=[flashrecovery]"]


@pytest.fixture(scope="module")
def fault_free(two_by_two):
    """The fault-free run of the same layout (tests/conftest.py)."""
    assert two_by_two.summary["status"] == "completed", two_by_two.output[-3000:]
    return two_by_two.summary


def assert_exact(run, fault_free, recoveries: int):
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["global_step"] == fault_free["global_step"]
    assert s["param_checksum"] == fault_free["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == fault_free["samples_committed"]
    assert len(s["recoveries"]) == recoveries, s["recoveries"]
    for r in s["recoveries"]:
        assert r["rpo_steps"] == 0
        assert r["rto_s"] > 0
        phases = r["detect_s"] + r["decide_s"] + r["replace_s"] + r["rebuild_s"] + r["restore_s"]
        assert phases == pytest.approx(r["rto_s"], abs=1e-6)
    return s


HSDP = ["parallel.zero=1", "parallel.dp_group_size=2"]  # two replica groups of two, each holding every shard


@pytest.mark.slow
def test_zero1_in_replica_groups_is_bit_identical_to_replicated_optimizer_state(fault_free, run_dir):
    """ZeRO-1 within DP replica groups (the shards all-gathered over each group's shard group) makes the very
    updates the replicated optimizer does."""
    run = run_cli(*FOUR, *FR, *HSDP, run_dir=run_dir)
    assert_exact(run, fault_free, recoveries=0)


@pytest.mark.slow
def test_kill_rank_with_zero1_takes_the_shard_from_the_other_replica_group(fault_free, run_dir):
    run = run_cli(*FOUR, *FR, *HSDP, "fault=kill_rank", "fault.rank=2", "fault.step=12", run_dir=run_dir)
    s = assert_exact(run, fault_free, recoveries=1)
    assert (s["recoveries"][0]["victims"], s["recoveries"][0]["action"]) == ([2], "restart_rank")
    assert [(e["rank"], e["holder"], e["replayed_updates"]) for e in run.events("shard_restored")] == [(2, 0, 0)]


def test_kill_rank_restarts_only_that_rank_and_loses_nothing(fault_free, rank0_killed):
    run = rank0_killed  # the shared run (tests/conftest.py): FOUR, FR, rank 0 killed at step 12, logged to W&B
    s = assert_exact(run, fault_free, recoveries=1)
    rec = s["recoveries"][0]
    assert (rec["fault"], rec["victims"], rec["step"], rec["action"]) == ("process_crash", [0], 12, "restart_rank")
    started = run.events("worker_started")
    assert len(started) == 5 and [e["role"] for e in started].count("joiner") == 1  # survivors never restarted
    restored = run.events("state_restored")
    assert len(restored) == 1 and restored[0]["role"] == "joiner"
    # shown live on the console, one line
    assert "[runner] step 12: rank 0 killed (SIGKILL) -> restarted in place; full world ready in " in run.output


@pytest.mark.slow
def test_kill_rank_with_a_lightning_module_we_did_not_write(tmp_path):
    boring = ["+recipe=gpt_tiny", "model._target_=lightning.pytorch.demos.boring_classes.BoringModel",
              "trainer.max_steps=16", *FR]
    clean = run_cli(*boring, run_dir=tmp_path / "clean")
    killed = run_cli(*boring, "fault=kill_rank", "fault.rank=1", "fault.step=6", run_dir=tmp_path / "killed")
    assert_exact(killed, clean.summary, recoveries=1)


HANG = [*FR, "fault=hang_rank", "fault.step=10"]  # the victim SIGSTOPped at step 10: add fault.rank


def test_hang_is_detected_killed_and_recovered(fault_free, run_dir):
    run = run_cli(*FOUR, *HANG, "fault.rank=1", run_dir=run_dir)
    assert_hang_recovered(run, fault_free, hung=1)


def assert_hang_recovered(run, fault_free, hung: int) -> None:
    """A run of FOUR with HANG: the hung rank found within the stall timeout, diagnosed (every other rank's stack and
    a verdict naming it) before it was killed, and recovered exactly."""
    s = assert_exact(run, fault_free, recoveries=1)
    rec = s["recoveries"][0]
    assert rec["fault"] == "hang" and rec["victims"] == [hung]
    assert rec["detect_s"] <= 10.0 + 0.1  # heartbeat.stall_timeout_s + one interval
    answering = [r for r in range(4) if r != hung]
    assert_diagnosed(run, rec, hung=hung, answering=answering)  # where everyone was before the kill


@pytest.mark.slow  # run time: a variant of what the default tier covers
def test_transient_error_is_retried_without_restarting_anyone(fault_free, run_dir):
    run = run_cli(*FOUR, *FR, "fault=transient", "fault.rank=3", "fault.step=8", run_dir=run_dir)
    s = assert_exact(run, fault_free, recoveries=1)
    assert s["recoveries"][0]["fault"] == "transient" and s["recoveries"][0]["action"] == "retry"
    assert len(run.events("worker_started")) == 4


@pytest.mark.slow
def test_a_rank_that_alone_misses_a_completed_reduction_adopts_the_committed_state(fault_free, run_dir):
    run = run_cli(*FOUR, *FR, "fault=transient", "fault.rank=1", "fault.step=8", "fault.during=after_reduce",
                  run_dir=run_dir)
    s = assert_exact(run, fault_free, recoveries=1)
    assert s["recoveries"][0]["action"] == "retry" and s["recoveries"][0]["rpo_steps"] == 0
    (laggard,) = [e for e in run.events("state_restored") if e["role"] == "laggard"]
    assert (laggard["rank"], laggard["step"]) == (1, 9)  # the others had committed step 8


@pytest.mark.slow
def test_a_warm_standby_takes_the_crashed_rank_exactly_and_is_replaced(fault_free, run_dir):
    run = run_cli(*FOUR, *FR, "ft.flashrecovery.standby=true", "runner.device=cpu", "fault=kill_rank", "fault.rank=1",
                  "fault.step=10", "+fault.extra=[{kind: kill_rank, rank: 3, step: 22}]", run_dir=run_dir)
    s = assert_exact(run, fault_free, recoveries=2)
    assert [r["victims"] for r in s["recoveries"]] == [[1], [3]]
    assigned = run.events("standby_assigned")
    assert [(e["logical"], e["node"]) for e in assigned] == [(1, 0), (3, 1)]  # each host's own standby
    for r in s["recoveries"]:
        assert r["survivors_ready_s"] is None  # the complete generation came at once: no survivors-only group
    started = run.events("worker_started")
    assert [e["role"] for e in started].count("joiner") == 0  # nobody was started after a crash...
    assert [e["role"] for e in started].count("spare") >= 3  # ...a standby per host, and a new one after the first


@pytest.mark.slow
def test_two_kills_at_different_steps(fault_free, run_dir):
    run = run_cli(*FOUR, *FR, "fault=kill_rank", "fault.rank=0", "fault.step=6",
                  "+fault.extra=[{kind: kill_rank, rank: 3, step: 20}]", run_dir=run_dir)
    s = assert_exact(run, fault_free, recoveries=2)
    assert [r["victims"] for r in s["recoveries"]] == [[0], [3]]


@pytest.mark.slow
def test_kill_during_the_recovery_from_another_kill(fault_free, run_dir):
    run = run_cli(*FOUR, *FR, "fault=kill_rank", "fault.rank=1", "fault.step=9",
                  "+fault.extra=[{kind: kill_rank, rank: 2, during: recovery}]", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["param_checksum"] == fault_free["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)
    victims = sorted(v for r in s["recoveries"] for v in r["victims"])
    assert victims == [1, 2]
    assert len(run.events("worker_started")) == 6


@pytest.mark.slow
def test_faults_while_several_buckets_are_in_flight_stay_exact(tmp_path):
    """20 KiB buckets: each step's backward launches many all-reduces before the reduction waits."""
    small = [*FOUR, *FR, "trainer.bucket_mb=0.02"]
    clean = run_cli(*small, run_dir=tmp_path / "clean")
    run = run_cli(*small, "fault=transient", "fault.rank=1", "fault.step=8",
                  "+fault.extra=[{kind: kill_rank, rank: 2, step: 16}]", run_dir=tmp_path / "faults")
    s = assert_exact(run, clean.summary, recoveries=2)
    assert [(r["fault"], r["action"]) for r in s["recoveries"]] == [("transient", "retry"),
                                                                    ("process_crash", "restart_rank")]


@pytest.mark.slow
def test_losing_every_replica_fails_clearly_and_never_hangs(run_dir):
    run = run_cli("+recipe=gpt_tiny", "trainer.max_steps=20", *FR, "fault=kill_rank", "fault.rank=0", "fault.step=5",
                  "+fault.extra=[{kind: kill_rank, rank: 1, step: 5}]", "policy.reject_unhandled=false",
                  run_dir=run_dir)
    s = run.summary
    assert run.returncode == 1
    assert s["status"] == "failed"
    assert "every data-parallel replica" in s["error"]


@pytest.mark.slow
def test_without_fault_tolerance_a_kill_fails_the_run_with_the_reason(run_dir):
    run = run_cli("+recipe=gpt_tiny", "trainer.max_steps=20", "fault=kill_rank", "fault.rank=1", "fault.step=5",
                  run_dir=run_dir)
    assert run.summary["status"] == "failed"
    assert "ft=flashrecovery" in run.summary["error"]


@pytest.mark.slow
def test_bitflip_is_detected_and_the_step_recomputed_exactly(fault_free, run_dir):
    run = run_cli(*FOUR, *FR, "fault=bitflip", "fault.rank=1", "fault.step=14", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["sdc_recomputed_steps"] == [14]
    assert s["param_checksum"] == fault_free["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)
    assert len(run.events("worker_started")) == 4


@pytest.mark.slow
def test_a_replacement_judges_corruption_like_the_ranks_it_joins(fault_free, run_dir):
    # a bitflip and a crash at the same step: the replacement gets the guard's history with the state,
    # so it rejects the corrupted reduction as the others do instead of running one step ahead
    run = run_cli(*FOUR, *FR, "fault=bitflip", "fault.rank=1", "fault.step=20",
                  "+fault.extra=[{kind: kill_rank, rank: 3, step: 20}]", run_dir=run_dir)
    s = assert_exact(run, fault_free, recoveries=1)
    assert s["sdc_recomputed_steps"] == [20]


@pytest.mark.slow
def test_slow_link_slows_the_job_without_a_recovery(fault_free, run_dir):
    # a delay large beside a step here (~0.04 s), so that a loaded host's noise cannot hide it
    delay_s = 0.2
    run = run_cli(*FOUR, *FR, "fault=slow_link", "fault.rank=2", "fault.step=10", f"fault.delay_s={delay_s}",
                  run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed" and s["recoveries"] == []
    assert s["param_checksum"] == fault_free["param_checksum"]
    metrics = {m["step"]: m for m in run.metrics()}
    # the victim sleeps before each step's reduction, which every rank's commit waits for: the 19 steps after the
    # fault take at least 19 delays (one spared for the metrics writer's own work after step 10's reduction)
    assert metrics[29]["t"] - metrics[10]["t"] >= 18 * delay_s
    before = statistics.median(metrics[k]["step_time_s"] for k in range(1, 10))
    after = statistics.median(metrics[k]["step_time_s"] for k in range(11, 30))
    assert after - before >= delay_s / 2  # each step waits for the late reduction (less what overlaps compute)


@pytest.mark.slow
def test_partition_is_retried_then_the_cut_off_rank_is_isolated_and_replaced(fault_free, run_dir):
    run = run_cli(*FOUR, *FR, "fault=partition", "fault.rank=1", "fault.step=10", run_dir=run_dir)
    s = assert_exact(run, fault_free, recoveries=2)
    assert [(r["fault"], r["action"]) for r in s["recoveries"]] == [("transient", "retry"),
                                                                    ("partition", "restart_rank")]
    assert s["recoveries"][1]["victims"] == [1]
