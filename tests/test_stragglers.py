"""Straggler detection (runner/control/stragglers.py): rank, host and link on synthetic timings, the config and
the policy row, and real runs of slow_rank and slow_link; acting on one (runner/control/handover.py): a slow rank's
host swapped for a spare host, a slow rank restarted in place, each at a committed step and exact. Every
fault-free test run is checked for false detections in tests/conftest.py (``assert_no_straggler``)."""

from __future__ import annotations

import random
import re

import pytest

from runner.config import ConfigError, policy
from runner.config.validate import validate
from runner.control.decision import decide_straggler
from runner.control.stragglers import StragglerJudge
from tests.conftest import ONE_BY_TWO, TINY, TWO_BY_TWO, run_cli
from tests.test_config import _compose


def feed(judge: StragglerJudge, steps: range, timing, hosts: dict[int, int]) -> list:
    """One heartbeat per rank per step, then a judgement; ``timing(step, rank)`` -> [compute, wait, link]."""
    found = []
    for step in steps:
        for rank, host in hosts.items():
            judge.add(rank, host, [[step, *timing(step, rank)]])
        found += judge.judge(set(hosts))
    return found


def balanced(compute: dict[int, float], link: dict[int, float] | None = None):
    """Waits as a synchronous reduction makes them: each rank waits for the slowest compute, plus the transfer
    (which the slowest link holds up for everyone)."""
    link = link or {}

    def timing(step: int, rank: int) -> list[float]:
        slowest = max(compute.values())
        transfer = 0.002 + max(link.values(), default=0.0)
        return [compute[rank], slowest - compute[rank] + transfer, link.get(rank, 0.00005)]
    return timing


ONE_HOST = {0: 0, 1: 0, 2: 0, 3: 0}
TWO_HOSTS = {0: 0, 1: 0, 2: 1, 3: 1}


def test_a_slow_rank_is_found_after_the_window_and_named_as_a_rank():
    judge = StragglerJudge(factor=1.2, window_steps=5, min_excess_s=0.005)
    found = feed(judge, range(20), balanced({0: 0.02, 1: 0.06, 2: 0.02, 3: 0.021}), ONE_HOST)
    assert len(found) == 1  # reported once
    f = found[0]
    assert (f.kind, f.rank, f.host, f.ranks, f.steps) == ("rank", 1, 0, [1], (0, 4))
    assert f.factor == pytest.approx(3.0, rel=0.05)
    assert f.evidence["compute_s"] == pytest.approx(0.06) and f.evidence["peers_compute_s"] == pytest.approx(0.02)


def test_one_normal_step_breaks_the_streak():
    judge = StragglerJudge(factor=1.2, window_steps=5, min_excess_s=0.005)

    def timing(step, rank):  # every 4th step rank 1 is as fast as the others
        slow = rank == 1 and step % 4 != 3
        return balanced({0: 0.02, 1: 0.06 if slow else 0.02, 2: 0.02, 3: 0.02})(step, rank)
    assert feed(judge, range(40), timing, ONE_HOST) == []


def test_every_rank_of_a_slow_host_is_one_host_finding():
    judge = StragglerJudge(factor=1.2, window_steps=4, min_excess_s=0.005)
    found = feed(judge, range(10), balanced({0: 0.02, 1: 0.02, 2: 0.05, 3: 0.05}), TWO_HOSTS)
    assert [(f.kind, f.host, f.ranks) for f in found] == [("host", 1, [2, 3])]


def test_a_slow_link_is_a_link_not_a_rank():
    """The victim's own launches carry the delay; every rank waits for its data, none computes longer."""
    judge = StragglerJudge(factor=1.2, window_steps=5, min_excess_s=0.005)
    compute = {r: 0.02 for r in ONE_HOST}
    found = feed(judge, range(12), balanced(compute, link={1: 0.2}), ONE_HOST)
    assert [(f.kind, f.rank, f.host) for f in found] == [("link", 1, 0)]
    assert found[0].evidence["link_s"] == pytest.approx(0.2)


def test_a_long_launch_explained_by_a_slower_peer_is_no_slow_link():
    """A rank whose wait is all waiting for a slower peer's compute has no unexplained wait: no link finding."""
    judge = StragglerJudge(factor=1.2, window_steps=3, min_excess_s=0.005)

    def timing(step, rank):
        compute = {0: 0.02, 1: 0.02, 2: 0.2, 3: 0.02}
        return [compute[rank], 0.2 - compute[rank] + 0.001, 0.03 if rank == 1 else 0.0001]
    found = feed(judge, range(6), timing, ONE_HOST)
    assert [(f.kind, f.rank) for f in found] == [("rank", 2)]


def test_noise_around_a_millisecond_step_is_no_straggler():
    """Ratios over 1.2 are common when a step takes a few ms; the absolute floor keeps them out."""
    rng = random.Random(0)
    judge = StragglerJudge(factor=1.2, window_steps=3, min_excess_s=0.005)

    def timing(step, rank):
        c = 0.002 * rng.uniform(0.5, 2.0)
        return [c, 0.001, 0.0001 * rng.uniform(0.5, 3)]
    assert feed(judge, range(500), timing, TWO_HOSTS) == []


def test_only_ranks_doing_the_same_work_are_peers():
    """With pp=2, a stage twice as slow as the other is no straggler; a slow rank among its stage's replicas is."""
    judge = StragglerJudge(factor=1.2, window_steps=3, min_excess_s=0.005, role=lambda rank: rank % 2)
    compute = {0: 0.02, 1: 0.04, 2: 0.02, 3: 0.04, 4: 0.02, 5: 0.09}  # rank % 2: the stage
    found = feed(judge, range(6), lambda step, rank: [compute[rank], 0.001, 0.0001], {r: r // 2 for r in compute})
    assert [(f.kind, f.rank) for f in found] == [("rank", 5)]


def test_a_step_some_rank_did_not_time_is_skipped_and_a_pause_forgets():
    judge = StragglerJudge(factor=1.2, window_steps=3, min_excess_s=0.005)
    timing = balanced({0: 0.02, 1: 0.06, 2: 0.02})
    hosts = {0: 0, 1: 0, 2: 0}
    for step in range(2):
        for rank in hosts:
            judge.add(rank, 0, [[step, *timing(step, rank)]])
    judge.add(0, 0, [[2, *timing(2, 0)]])  # ranks 1 and 2 did not time step 2 (a lost beat)
    judge.add(1, 0, [[3, *timing(3, 1)]])
    judge.add(2, 0, [[3, *timing(3, 2)]])
    judge.add(0, 0, [[3, *timing(3, 0)]])
    assert [(f.rank, f.steps) for f in judge.judge(set(hosts))] == [(1, (0, 3))]  # step 2 neither counts nor breaks
    judge = StragglerJudge(factor=1.2, window_steps=3, min_excess_s=0.005)
    feed(judge, range(2), timing, hosts)
    judge.pause()  # a recovery: the streak starts over
    assert feed(judge, range(2, 4), timing, hosts) == []
    assert [f.steps for f in feed(judge, range(4, 5), timing, hosts)] == [(2, 4)]


def test_a_heartbeat_repeating_steps_counts_each_once_and_waits_for_the_slowest_reporter():
    judge = StragglerJudge(factor=1.2, window_steps=2, min_excess_s=0.005)
    timing = balanced({0: 0.02, 1: 0.06})
    recs = {r: [[s, *timing(s, r)] for s in range(3)] for r in (0, 1)}
    judge.add(0, 0, recs[0])
    judge.add(0, 0, recs[0])
    judge.add(1, 0, recs[1][:1])
    assert judge.judge({0, 1}) == []  # only step 0 is timed by both
    judge.add(1, 0, recs[1])
    assert [(f.rank, f.steps) for f in judge.judge({0, 1})] == [(1, (0, 1))]


# -- config and policy ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, says", [
    ("straggler.factor=1.0", "straggler.factor (1.0) must be > 1"),
    ("straggler.window_steps=0", "straggler.window_steps (0) must be >= 1"),
    ("straggler.min_excess_s=-1", "straggler.min_excess_s (-1.0) must be >= 0"),
    ("straggler.quarantine_s=-1", "straggler.quarantine_s (-1.0) must be >= 0"),
    ("policy.straggler=[takeover]", "cannot handle straggler faults; use any of restart_rank, swap_spare, report"),
    ("policy.straggler=[swap_spare]", "which needs ft=deadpool"),
])
def test_bad_straggler_settings_are_refused(override, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        validate(_compose("+recipe=gpt_tiny", "ft=flashrecovery", override))


def test_a_straggler_swap_without_a_spare_host_is_refused_at_config_time():
    cfg = _compose("+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", "parallel.spares=1",
                   "ft=[deadpool]", "policy.straggler=[swap_spare]")
    with pytest.raises(ConfigError, match=re.escape("parallel.spares=1 is fewer than the 2 rank(s) of a host: set "
                                                    "parallel.spares=2")):
        validate(cfg)


def _straggler_decision(kind: str, spares: int, *overrides: str, restarts_left: int = 3):
    pool = ["parallel.spares=2"] if "ft=[deadpool]" in overrides else []
    cfg = _compose("+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", *pool, *overrides)
    validate(cfg)
    return decide_straggler(ft=list(cfg.ft), cfg=cfg, kind=kind, rank=3, host_ranks=[2, 3], can_restart=True,
                            restarts_left=restarts_left, spares=spares)


def test_the_straggler_row_moves_a_host_restarts_a_rank_and_falls_back_to_report():
    swap = _straggler_decision("rank", 2, "ft=[deadpool]", "policy.straggler=[swap_spare,report]")
    assert (swap.action, swap.victims, swap.fault_class) == ("swap_spare", [2, 3], "straggler")
    spent = _straggler_decision("rank", 1, "ft=[deadpool]", "policy.straggler=[swap_spare,report]")
    assert (spent.action, spent.victims) == ("report", []) and "only 1 ready spare(s) for 2 rank(s)" in spent.reason
    restart = _straggler_decision("rank", 0, "ft=[flashrecovery]", "policy.straggler=[restart_rank]")
    assert (restart.action, restart.victims) == ("restart_rank", [3])
    host = _straggler_decision("host", 0, "ft=[flashrecovery]", "policy.straggler=[restart_rank]")
    assert host.action == "report" and "a restart does not make a slow host faster" in host.reason
    assert _straggler_decision("rank", 0, "ft=[flashrecovery]", "policy.straggler=[restart_rank]",
                               restarts_left=0).action == "report"
    assert _straggler_decision("rank", 2, "ft=[deadpool]").action == "report"  # the default row, spares or not


def test_the_straggler_row_reports_by_default_and_a_run_logs_it():
    cfg = _compose("+recipe=gpt_tiny", "straggler.window_steps=5")
    validate(cfg)
    assert policy.table(cfg, [])["straggler"] == ["report"] and cfg.straggler.factor == 1.2


# -- real runs ----------------------------------------------------------------------------------------------
WINDOW = 5
SLOW_FROM = 5
SLOW = [*TINY, "trainer.max_steps=20", f"straggler.window_steps={WINDOW}", "fault.rank=1", f"fault.step={SLOW_FROM}"]


def committed_at(run, t: float) -> int:
    """The newest step committed before time ``t``."""
    return max(m["step"] for m in run.metrics() if m["t"] <= t)


def test_a_slow_rank_is_reported_as_a_rank_within_the_window_and_the_run_goes_on(run_dir):
    # the victim sleeps 0.15 s before every step from step 5 on: about 3x gpt_tiny's step here
    run = run_cli(*SLOW, "fault=slow_rank", "fault.delay_s=0.15", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed" and s["recoveries"] == [], run.output[-3000:]
    found = run.events("straggler_detected")
    assert [(e["straggler"], e["rank"], e["host"], e["action"]) for e in found] == [("rank", 1, 0, "report")], found
    assert found[0]["factor"] > 1.2 and found[0]["at_step"] >= SLOW_FROM  # its streak ends in the slowness
    assert committed_at(run, found[0]["t"]) <= SLOW_FROM + WINDOW + 5
    assert "rank 1 is a straggler" in run.output  # the console's line
    assert [m["step"] for m in run.metrics()] == list(range(20))  # nothing was done about it


def test_a_slow_link_is_reported_as_a_link_not_as_a_slow_rank(run_dir):
    run = run_cli(*SLOW, "fault=slow_link", "fault.delay_s=0.1", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed" and s["recoveries"] == [], run.output[-3000:]
    found = run.events("straggler_detected")
    assert [(e["straggler"], e["rank"], e["host"]) for e in found] == [("link", 1, 0)], found
    assert committed_at(run, found[0]["t"]) <= SLOW_FROM + WINDOW + 5
    assert "slow link at rank 1" in run.output


def test_the_experiment_logger_gets_a_straggler_as_an_event_row(tmp_path):
    from omegaconf import OmegaConf

    from runner.control.records import RunRecord
    from runner.control.run_logger import RunLogger
    from runner.plumbing.events import JsonLines
    from tests.test_wandb_run import Recorder, commit

    metrics, events = JsonLines(tmp_path / "metrics.jsonl"), JsonLines(tmp_path / "events.jsonl")
    cfg = OmegaConf.create({"trainer": {"log_every_n_steps": 100}, "logger": {"kind": "csv"}})
    logger = RunLogger(cfg, tmp_path, RunRecord(ft=[], dp=2, t_start=100.0))
    logger.backend = backend = Recorder()
    metrics.write(commit(9, 101.0, 0))
    events.write({"t": 101.5, "step": -1, "rank": 1, "kind": "straggler_detected", "straggler": "rank", "host": 0,
                  "factor": 2.1, "action": "report"})
    logger.follow()
    row = backend.rows[-1]
    assert (row["event/kind"], row["global_step"]) == ("straggler_detected", 10)
    assert '"straggler": "rank"' in row["event/text"]


# -- acting on a straggler: the planned hand-over (runner/control/handover.py) -------------------------------------
# rank 3 (host 1) sleeps 0.3 s before every step from step 5 on: about 3x gpt_tiny's step on 4 ranks here. The
# slowness is its process's (fault.slow_rank strikes the process that started as the rank, not a replacement)
# A window of 10 steps: at 5, the noise of a host loaded by other jobs (and the first steps' lazily connected links)
# made a rank or a link look slow for 5 steps now and then, and a swap acts on the first finding
ACT_WINDOW = 10
SLOW_HOST = [*TWO_BY_TWO, f"straggler.window_steps={ACT_WINDOW}", "fault=slow_rank", "fault.rank=3",
             f"fault.step={SLOW_FROM}", "fault.delay_s=0.3"]
SPARE_HOST = [*SLOW_HOST, "parallel.spares=2", "ft=[deadpool]"]


def assert_exact(run, fault_free) -> dict:
    """Completed with the fault-free run's parameters, nothing lost or duplicated; returns the summary."""
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["param_checksum"] == fault_free["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_committed"]) == \
        (0, 0, fault_free["samples_committed"])
    return s


def test_a_slow_rank_with_a_spare_host_is_swapped_out_with_its_host_at_a_committed_step_exactly(two_by_two, run_dir):
    run = run_cli(*SPARE_HOST, "policy.straggler=[swap_spare,report]", run_dir=run_dir)
    assert_swapped_out(run, two_by_two.summary)


def assert_swapped_out(run, fault_free) -> None:
    """SPARE_HOST's run with ``policy.straggler=[swap_spare,report]``: rank 3 found slow within the window, its host's
    ranks released (not killed) at a committed step and taken by the spare host, the fault-free run exactly, and the
    pace after the swap no longer the straggler's."""
    s = assert_exact(run, fault_free)
    # the first finding; on a loaded 2-core host a later one may be noise, and with the spares spent the row's next
    # action, report, is all it gets
    found, *later = run.events("straggler_detected")
    assert (found["straggler"], found["rank"], found["host"], found["action"]) == ("rank", 3, 1, "swap_spare"), found
    assert all(e["action"] == "report" for e in later), later
    assert committed_at(run, found["t"]) <= SLOW_FROM + ACT_WINDOW + 5
    rec = run.only_recovery()
    assert (rec["fault"], rec["action"], rec["victims"], rec["decide_reason"], rec["rpo_steps"]) == \
        ("straggler", "swap_spare", [2, 3], "planned", 0)
    assert {e["node"] for e in run.events("spare_assigned")} == {2}  # the spare host takes both of host 1's ranks
    # released, not killed: each of host 1's workers ended its fit cleanly, at the step everyone had committed
    released = run.events("worker_released")
    assert sorted(e["logical"] for e in released) == [2, 3], released
    (entry,) = [e for e in s["stragglers"] if e["recovery"] == rec["id"]]
    assert_released_at_handover(run, released, entry["handover_step"])
    assert not run.events("worker_killed") and not run.events("worker_fenced")
    (host,) = run.events("host_released")
    assert host["node"] == 1 and not run.events("host_rejoined")  # quarantined for straggler.quarantine_s (600 s)
    assert [m["step"] for m in run.metrics()][-1] == 29
    # the pace, same run: after the swap the job no longer waits for the straggler (the fault-free pace and the 10 %
    # bound are bench/straggler.py's, a timing claim this loaded host cannot hold to)
    pace = entry["steps_per_s"]
    assert pace["after"] > 1.5 * pace["slow"], pace


def assert_released_at_handover(run, released: list[dict], handover: int) -> None:
    """Each released worker left at the hand-over step: it had committed exactly the steps before it, or that
    step too when the step's reduction ended on it but failed on a member that stays (a ring all-reduce can end on
    some members first; the new generation cuts the rest off, or the released workers' dropped connections end
    it). Then that member's failed collective of the step is logged, and the new generation redid the step,
    counted once (``assert_exact``)."""
    leaving = {e["logical"] for e in released}
    for e in released:
        if e["committed_steps"] == handover + 1:
            failed = [c for c in run.events("collective_failed") if c["rank"] not in leaving and c["step"] == handover]
            assert failed, (e, run.events("collective_failed"))
        else:
            assert e["committed_steps"] == handover, (e, handover)


def test_a_released_host_rejoins_as_a_spare_after_its_quarantine(two_by_two, run_dir):
    run = run_cli(*SPARE_HOST, "policy.straggler=[swap_spare]", "straggler.quarantine_s=0", run_dir=run_dir)
    assert_exact(run, two_by_two.summary)
    (host,) = run.events("host_released")
    (rejoined,) = run.events("host_rejoined")
    assert rejoined["node"] == host["node"] == 1 and rejoined["t"] >= max(e["t"] for e in run.events("worker_released"))
    spares = [e for e in run.events("worker_started") if e["node"] == 1 and e["role"] == "spare"]
    assert len(spares) == 2  # a warm spare in each of its slots


def test_a_slow_rank_without_a_spare_is_reported_and_nothing_is_done(two_by_two, run_dir):
    run = run_cli(*SLOW_HOST, "ft=[deadpool]", run_dir=run_dir)
    s = assert_exact(run, two_by_two.summary)
    assert s["recoveries"] == [] and not run.events("worker_released")
    found = run.events("straggler_detected")
    assert (found[0]["straggler"], found[0]["rank"], found[0]["action"]) == ("rank", 3, "report")
    assert all(e["action"] == "report" and e["recovery"] is None for e in s["stragglers"])


def test_a_slow_rank_is_restarted_in_place_state_from_its_replica_exactly(one_by_two, run_dir):
    run = run_cli(*ONE_BY_TWO, f"straggler.window_steps={ACT_WINDOW}", "fault=slow_rank", "fault.rank=1",
                  f"fault.step={SLOW_FROM}", "fault.delay_s=0.15", "ft=[flashrecovery]",
                  "policy.straggler=[restart_rank]", run_dir=run_dir)
    assert_exact(run, one_by_two.summary)
    rec = run.only_recovery()
    assert (rec["fault"], rec["action"], rec["victims"], rec["rpo_steps"]) == ("straggler", "restart_rank", [1], 0)
    (released,) = run.events("worker_released")
    joiners = [e for e in run.events("worker_started") if e["role"] == "joiner"]
    assert released["logical"] == 1 and len(joiners) == 1 and joiners[0]["node"] == 0
    (entry,) = [e for e in run.summary["stragglers"] if e["recovery"] == rec["id"]]
    assert_released_at_handover(run, [released], entry["handover_step"])
