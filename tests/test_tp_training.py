"""Tensor-parallel training on real processes: TP=2 inside each node, DP=2 across nodes.

The fault-free TP run serves as the reference for the loss curve (against pure DP with the same global
batch) and for FlashRecovery's exactness (its recovered run must end with the same checksum).
"""

from __future__ import annotations

import pytest

from tests.conftest import TP2_DP2, TP2_DP2_STEPS, run_cli

MAX_STEPS = TP2_DP2_STEPS
TP2 = [*TP2_DP2, f"trainer.max_steps={MAX_STEPS}"]
FR = ["ft=[flashrecovery]"]


@pytest.fixture(scope="module")
def tp2(tp2_dp2):
    """The fault-free run of TP2 with FR (shared, tests/conftest.py; its checkpoints do not change its training)."""
    return tp2_dp2


@pytest.mark.slow  # run time: test_tensor_parallel.py checks tp=2 against the unsharded model
def test_tp2_dp2_trains_and_matches_pure_data_parallel(tp2, run_dir):
    dp2 = run_cli("+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=1", f"trainer.max_steps={MAX_STEPS}",
                  *FR, run_dir=run_dir)  # the same DP size and global batch, one rank per replica
    assert dp2.summary["status"] == "completed", dp2.output[-4000:]
    s, ref = tp2.summary, dp2.summary
    assert s["global_step"] == MAX_STEPS and s["final_loss"] < s["initial_loss"] - 0.3
    assert len(tp2.events("worker_started")) == 4  # one process per rank: 2 replicas x 2 TP ranks
    # each replica is counted once, not once per TP rank
    for key in ("samples_committed", "tokens_committed"):
        assert s[key] == ref[key]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    tp_loss = [m["loss"] for m in tp2.metrics()]
    dp_loss = [m["loss"] for m in dp2.metrics()]
    assert len(tp_loss) == len(dp_loss) == MAX_STEPS
    for step, (a, b) in enumerate(zip(tp_loss, dp_loss)):
        assert a == pytest.approx(b, rel=0.01), f"step {step}: tp=2 loss {a} vs tp=1 loss {b}"
    assert all(m["counts"] == [1, 1] for m in tp2.metrics())  # one count per replica per step


def test_flashrecovery_kill_rank_at_tp2_restores_the_tp_slice_exactly(tp2, run_dir):
    # rank 1 is the second TP slice of replica 0: its partner fails inside a TP collective, and the
    # replacement takes its slice from rank 3, the replica at the same TP coordinate
    run = run_cli(*TP2, *FR, "fault=kill_rank", "fault.rank=1", "fault.step=8", run_dir=run_dir)
    s, ref = run.summary, tp2.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["global_step"] == ref["global_step"]
    assert s["param_checksum"] == ref["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == ref["samples_committed"]
    rec = s["recoveries"]
    assert len(rec) == 1 and (rec[0]["fault"], rec[0]["victims"], rec[0]["action"]) == (
        "process_crash", [1], "restart_rank")
    assert rec[0]["rpo_steps"] == 0
    restored = run.events("state_restored")
    assert len(restored) == 1 and restored[0]["role"] == "joiner"
    sent = run.events("state_sent")
    assert [e["rank"] for e in sent] == [3]  # the DP replica at TP coordinate 1


@pytest.mark.parametrize("overrides, says", [
    (["model.dropout=0.1"], "set model.dropout=0 or parallel.tp=1"),
])
def test_a_mix_tensor_parallelism_does_not_train_is_refused(overrides, says, run_dir):
    run = run_cli(*TP2, *overrides, run_dir=run_dir, timeout=120)
    assert run.returncode == 2, run.output[-3000:]
    assert says in run.output
    assert not (run_dir / "events.jsonl").exists()


@pytest.mark.slow
def test_flash_ckpt_kill_all_at_tp2_restores_each_ranks_own_slice(tp2, run_dir):
    run = run_cli(*TP2, "ft=[flash_ckpt]", "fault=kill_all", "fault.step=8", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["global_step"] == MAX_STEPS
    assert s["param_checksum"] == tp2.summary["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [
    ["fault=kill_rank", "fault.rank=0", "fault.step=5"],  # TP slice 0 of replica 0 (it writes the metrics)
    ["fault=transient", "fault.rank=2", "fault.step=11"],  # every rank alive: the group rebuilt, the step redone
])
def test_flashrecovery_at_tp2_is_exact(fault, tp2, run_dir):
    run = run_cli(*TP2, *FR, *fault, run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["param_checksum"] == tp2.summary["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert len(s["recoveries"]) == 1 and s["recoveries"][0]["rpo_steps"] == 0


NDB_KILL = ["ft=[ndb]", "fault=kill_rank", "fault.step=8"]


def assert_replica_taken_over(run, ref, failed: int, stopped: int, neighbours: list[tuple[int, int]]):
    """The failed rank's replica left whole (its other rank stopped, nobody restarted), each of its ranks computed
    by the neighbour replica's rank at the same TP coordinate, and every sample accounted exactly once."""
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["global_step"] == MAX_STEPS and len(run.events("worker_started")) == 4
    assert [(e["wid"], e["failed"]) for e in run.events("replica_stopped")] == [(stopped, failed)]
    assert sorted((e["logical"], e["neighbour_wid"]) for e in run.events("takeover_assigned")) == neighbours
    assert sorted(t["extra_ranks"] for t in s["takeovers"]) == [[r] for r, _ in neighbours]
    (rec,) = s["recoveries"]
    assert (rec["action"], rec["victims"], rec["rpo_steps"]) == ("takeover", [failed], 0)
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    for key in ("samples_committed", "tokens_committed"):  # the global batch is unchanged
        assert s[key] == ref[key]
    assert all(m["counts"] == [1, 1] for m in run.metrics())  # one count per replica, the taken-over one included
    return s


@pytest.mark.slow
def test_ndb_kill_rank_at_tp2_takes_the_replica_over_and_without_approximations_is_exact(tp2, run_dir):
    # rank 2 is TP slice 0 of replica 1: its partner rank 3 is stopped, and replica 0's ranks 0 and 1 compute
    # ranks 2 and 3 besides their own; computed exactly, the run is the fault-free one bit for bit
    run = run_cli(*TP2, *NDB_KILL, "fault.rank=2", "ft.ndb.exact_reference=true", run_dir=run_dir)
    s = assert_replica_taken_over(run, tp2.summary, failed=2, stopped=3, neighbours=[(2, 0), (3, 1)])
    assert s["param_checksum"] == tp2.summary["param_checksum"]


@pytest.mark.slow
def test_ndb_kill_rank_at_tp2_with_every_approximation_trains_within_one_percent(tp2, run_dir):
    # rank 1 fails: replica 0 (rank 0 writes the metrics) leaves, replica 1 takes it over with attention skipped,
    # the FFN recomputed and low-rank weight gradients over each TP slice from the first step (no warm-up)
    run = run_cli(*TP2, *NDB_KILL, "fault.rank=1", "ft.ndb.warmup_steps=0", run_dir=run_dir)
    s = assert_replica_taken_over(run, tp2.summary, failed=1, stopped=0, neighbours=[(0, 2), (1, 3)])
    ref = tp2.summary
    assert len(run.metrics()) == MAX_STEPS and s["final_loss"] < s["initial_loss"] - 0.3
    assert abs(s["final_loss"] - ref["final_loss"]) / ref["final_loss"] < 0.01
