"""Per-phase hang timeouts calibrated from the run (``runner.control.phase_timeouts``): the rule alone, then real runs
where a hang on a fast step is found in a fraction of ``stall_timeout_s`` and a slow but steady phase is never one."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.config.validate import validate
from runner.control.detection import Detector
from runner.control.phase_timeouts import MATERIAL, PhaseTimeouts, p99
from tests.conftest import TWO_BY_TWO, run_cli
from tests.test_config import _compose
from tests.test_flashrecovery import FR, assert_exact


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, kind: str, **fields) -> None:
        self.emitted.append((kind, fields))


LAUNCHER = OmegaConf.create({"collective_timeout_s": 30.0, "start_timeout_s": 120.0, "recovery_timeout_s": 60.0})


def timeouts(events=None, group_rules=True, **pt) -> PhaseTimeouts:
    hb = OmegaConf.create({"stall_timeout_s": 10.0, "phase_timeouts": {"enabled": True, "k": 4.0, "floor_s": 0.5,
                                                                       "warmup_steps": 3, **pt}})
    return PhaseTimeouts(hb, LAUNCHER, events, group_rules=group_rules)


def test_a_phase_waits_stall_timeout_s_until_it_was_seen_at_warmup_steps_then_k_times_its_p99():
    t = timeouts()
    assert t.limit("reduce") is None and t.limit("recovering") is None  # waiting for others: never judged
    t.observe("compute", 0, 0.3)
    t.observe("compute", 0, 0.2)  # another rank, the same step
    t.observe("compute", 1, 0.1)
    assert t.limit("compute") == (10.0, False)  # two distinct steps of three
    t.observe("takeover", 2, 0.25)  # NDB's extra micro-batch counts as compute
    assert t.limit("compute") == (pytest.approx(4 * 0.3), True)
    assert t.limit("checkpoint") == (10.0, False)  # a phase without data keeps the fallback
    for step in range(3, 600):
        t.observe("compute", step, 0.01)
    assert t.limit("compute") == (0.5, True)  # the floor: p99 of mostly 10 ms dwells is 10 ms or so
    assert p99([0.01] * 99 + [5.0]) == 0.01 and p99([0.01] * 98 + [5.0, 5.0]) == 5.0


def test_disabled_every_judged_phase_waits_its_fixed_bound():
    t = timeouts(enabled=False)
    for step in range(50):
        t.observe("compute", step, 0.01)
        t.observe("reduce", step, 0.01)
    t.observe_startup("joiner", 0.3)
    t.observe_recovery("retry", 0.1)
    assert t.limit("compute") == (10.0, False) and t.limit("checkpoint") == (10.0, False)
    assert t.reduction_limit() is None and t.recovery_limit("retry") is None  # the workers' own timeouts
    assert t.startup_limit("joiner") == (120.0, False)


def test_the_reduction_is_calibrated_from_the_reduce_and_sync_dwells_of_every_rank():
    t = timeouts()
    for step in range(2):
        t.observe("reduce", step, 0.05)
    t.observe("sync", 1, 0.2)  # ZeRO-1's parameter all-gather: a collective of every member too
    assert t.reduction_limit() is None  # two distinct steps of three: the collective timeout alone
    t.observe("reduce", 2, 0.3)
    assert t.reduction_limit() == pytest.approx(4 * 0.3)
    assert t.limit("reduce") is None  # never a single rank's hang: it waits for a peer
    assert t.state()["reduction"] == {"timeout_s": 1.2, "calibrated": True, "p99_s": 0.3, "dwells": 4, "steps": 3,
                                      "backoff": 1}
    t.acted("reduction")  # a false alarm on a link slower for good is not repeated for ever
    assert t.reduction_limit() == pytest.approx(2 * 4 * 0.3) and t.state()["reduction"]["backoff"] == 2
    nccl = timeouts(group_rules=False)  # an NCCL wait is not sliced: a cut-off could not end it
    for step in range(5):
        nccl.observe("reduce", step, 0.05)
    assert nccl.reduction_limit() is None
    assert nccl.state()["reduction"]["timeout_s"] == 30.0 and not nccl.state()["reduction"]["calibrated"]


def test_startups_and_regroups_are_calibrated_per_role_and_action_from_the_slowest_seen():
    events = Events()
    t = timeouts(events)
    assert t.startup_limit("initial") == (120.0, False) and t.recovery_limit("retry") is None
    for seconds in (0.05, 0.4, 0.2):  # the first generation's ranks: the slowest counts, not a p99 of few
        t.observe_startup("initial", seconds)
    assert t.startup_limit("initial") == (pytest.approx(1.6), True)
    assert t.startup_limit("joiner") == (120.0, False)  # a replacement proves its host first: not alike
    for seconds in (0.05, 0.02):  # one or two start-ups of a kind are no distribution: the fixed bound still
        t.observe_startup("joiner", seconds)
        t.observe_recovery("retry", seconds / 2)
        assert t.startup_limit("joiner") == (120.0, False) and t.recovery_limit("retry") is None
    t.observe_startup("joiner", 0.01)
    assert t.startup_limit("joiner") == (0.5, True)  # the floor
    t.observe_recovery("retry", 0.02)
    assert t.recovery_limit("retry") == 0.5 and t.recovery_limit("restart_all") is None
    t.publish()
    (logged,) = [f for kind, f in events.emitted if kind == "phase_timeouts"]
    assert logged["changed"] == ["recovery", "startup"]
    assert logged["timeouts"]["startup"] == {"timeout_s": 120.0, "calibrated": True, "backoff": 1, "kinds": {
        "initial": {"timeout_s": 1.6, "calibrated": True, "slowest_s": 0.4, "samples": 3},
        "joiner": {"timeout_s": 0.5, "calibrated": True, "slowest_s": 0.05, "samples": 3}}}
    assert logged["timeouts"]["recovery"]["kinds"]["retry"]["timeout_s"] == 0.5
    t.acted("recovery")
    assert t.recovery_limit("retry") == 1.0 and t.startup_limit("joiner") == (0.5, True)
    t.acted("startup")  # a start-up killed: the next of the role gets twice as long
    assert t.startup_limit("joiner") == (1.0, True) and t.startup_limit("spare") == (120.0, False)
    t.observe_recovery("retry", 0.3)  # 2.4 s against 0.5 s logged: moved; so did the start-ups, by their back-off
    t.publish()
    assert [f["changed"] for kind, f in events.emitted if kind == "phase_timeouts"][-1] == ["recovery", "startup"]


def test_a_worker_spawned_in_the_wave_that_calibrated_its_role_keeps_the_fixed_start_up_bound():
    """Three of a job's four first ranks beat within 0.4 s; the fourth, spawned with them on a loaded host, is not
    held to 1.6 s (its own wave is no distribution of its start-up); a rank spawned after that is."""
    t = timeouts(Events())
    for seen_at, seconds in ((10.05, 0.05), (10.2, 0.2), (10.4, 0.4)):  # spawned at 10.0, seen in this order
        t.observe_startup("initial", seconds, at=seen_at)
    assert t.startup_limit("initial", spawned_at=10.0) == (120.0, False)
    assert t.startup_limit("initial", spawned_at=10.3) == (120.0, False)  # before the third start-up was seen
    assert t.startup_limit("initial", spawned_at=11.0) == (pytest.approx(1.6), True)


def test_the_timeouts_are_logged_when_calibrated_and_when_they_move_materially():
    events = Events()
    t = timeouts(events)
    for step in range(3):
        t.observe("compute", step, 0.2)
    t.publish()
    t.publish()  # nothing moved
    t.observe("compute", 3, 0.21)
    t.publish()  # 0.84 vs 0.8: within 20 %
    for step in range(4, 8):
        t.observe("compute", step, 1.0)
    t.publish()
    logged = [f for kind, f in events.emitted if kind == "phase_timeouts"]
    assert [(f["changed"], f["timeouts"]["compute"]["timeout_s"]) for f in logged] == [(["compute"], 0.8),
                                                                                       (["compute"], 4.0)]
    assert logged[0]["timeouts"]["checkpoint"] == {"timeout_s": 10.0, "calibrated": False, "p99_s": None,
                                                   "dwells": 0, "steps": 0}
    assert set(logged[0]["timeouts"]) == {"compute", "checkpoint", "reduction", "startup", "recovery"}


CALIBRATED = ["heartbeat.phase_timeouts.warmup_steps=5", "heartbeat.phase_timeouts.floor_s=0.5"]
STALL_TIMEOUT_S = 10.0  # heartbeat.stall_timeout_s, the default


def test_a_stalls_reason_gives_the_timeout_it_records():
    """The reason says the recorded (rounded) timeout: 0.82249 records 0.8225, and both read 0.823 to 3 figures (the
    unrounded value reads 0.822, which a CI run once found in the reason beside a recorded 0.8225)."""
    worker = SimpleNamespace(hb_phase="compute", hb_step=25, hb_step_change=0.0)
    why, kind, rule = Detector.stall(SimpleNamespace(), worker, now=5.0, limit=(0.82249, True))  # type: ignore[arg-type]
    assert (kind, rule) == ("hang", {"phase": "compute", "timeout_s": 0.8225, "calibrated": True})
    assert f"for {rule['timeout_s']:.3g}s (calibrated from this run)" in why


def test_a_hang_on_a_fast_step_is_found_by_its_calibrated_timeout(two_by_two, run_dir):
    """Rank 1's training thread blocks at step 25 while its heartbeats go on (fault.hang=stall): no heartbeat rule
    can find it, only the step that does not advance."""
    run = run_cli(*TWO_BY_TWO, *FR, *CALIBRATED, "fault=hang_rank", "fault.hang=stall", "fault.rank=1",
                  "fault.step=25", run_dir=run_dir)
    s = assert_exact(run, two_by_two.summary, recoveries=1)
    rec = s["recoveries"][0]
    assert (rec["fault"], rec["victims"]) == ("hang", [1])
    stall = rec["stall"]  # the rule that found it, with the timeout in effect then
    assert stall["phase"] == "compute" and stall["calibrated"], rec
    timeout_s = stall["timeout_s"]
    assert 0.5 <= timeout_s < STALL_TIMEOUT_S / 2
    # the worker entered the step's compute before it was stopped, so the stop is found within the timeout (and the
    # controller's next judging round): a fraction of stall_timeout_s and of the 10 s heartbeat rule
    assert rec["detect_s"] <= timeout_s + 1.0 and rec["detect_s"] < STALL_TIMEOUT_S / 2, rec
    (killed,) = run.events("worker_killed")
    logged = [e["timeouts"]["compute"] for e in run.events("phase_timeouts")
              if e["t"] < killed["t"] and "compute" in e["changed"]]
    assert logged and all(c["calibrated"] for c in logged)
    assert abs(logged[-1]["timeout_s"] - timeout_s) <= MATERIAL * logged[-1]["timeout_s"]  # logged as it moved
    assert rec["verdict"].startswith("ranks 0, 2, 3 stuck in all_reduce of step 25") and "rank 1 in compute" in \
        rec["verdict"], rec["verdict"]  # where everyone was: rank 1 answered, inside its step
    assert "_stall" in (run.dir / rec["diagnosis"] / "rank1.stacks.txt").read_text()
    assert f"for {timeout_s:.3g}s (calibrated from this run)" in killed["reason"]


def test_a_slow_but_steady_phase_is_never_a_hang(two_by_two, run_dir):
    """A floor of 0.2 s under 0.4 s steps (rank 0 sleeps before each, every step of the run) and a checkpoint
    every 5 steps: a fixed 0.2 s timeout would kill rank 0; the calibrated one stays above its steps. Without fault
    tolerance, so that any false hang would end the run."""
    run = run_cli(*TWO_BY_TWO, "heartbeat.phase_timeouts.warmup_steps=5", "heartbeat.phase_timeouts.floor_s=0.2",
                  "fault=slow_rank", "fault.rank=0", "fault.step=0", "fault.delay_s=0.4", "checkpoint.every_n_steps=5",
                  run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    assert s["recoveries"] == [] and not run.events("worker_killed")
    assert s["param_checksum"] == two_by_two.summary["param_checksum"]
    compute = s["phase_timeouts"]["compute"]
    assert compute["calibrated"] and compute["p99_s"] >= 0.4 and compute["timeout_s"] > 0.4, compute


COLLECTIVE_TIMEOUT_S = 30.0  # launcher.collective_timeout_s, the default: what ends a stuck reduction without the rule


def test_a_reduction_stuck_on_every_member_is_cut_off_by_its_calibrated_timeout(two_by_two, run_dir):
    """Rank 1's part of step 15's reduction never leaves it (``fault.during=reduction``: a link dropping packets
    silently), so every rank waits in the reduction and nobody computes: no rank's own rule can find it. The controller
    cuts the generation off after the calibrated reduction timeout, every member gives the collective up, and the
    retry completes the run exactly."""
    run = run_cli(*TWO_BY_TWO, *FR, *CALIBRATED, "fault=transient", "fault.during=reduction", "fault.rank=1",
                  "fault.step=15", run_dir=run_dir)
    s = assert_exact(run, two_by_two.summary, recoveries=1)
    rec = s["recoveries"][0]
    assert (rec["fault"], rec["action"], rec["victims"]) == ("transient", "retry", []), rec
    stuck = rec["stall"]
    assert stuck["phase"] == "reduction" and stuck["calibrated"], rec
    assert 0.5 <= stuck["timeout_s"] < COLLECTIVE_TIMEOUT_S / 4
    # found within the timeout and the controller's next judging round, far inside the collective timeout
    assert rec["detect_s"] <= stuck["timeout_s"] + 1.0 and rec["detect_s"] < COLLECTIVE_TIMEOUT_S / 4, rec
    (cut,) = run.events("generation_cut_off")
    assert cut["phase"] == "reduction" and "in the reduction of step 15" in cut["reason"], cut
    logged = [e["timeouts"]["reduction"] for e in run.events("phase_timeouts") if e["t"] < cut["t"]]
    assert logged and logged[-1]["calibrated"]
    assert abs(logged[-1]["timeout_s"] - stuck["timeout_s"]) <= MATERIAL * logged[-1]["timeout_s"]
    assert rec["verdict"].startswith("ranks 0, 1, 2, 3 stuck in all_reduce of step 15 (gen 0)"), rec["verdict"]
    assert not run.events("worker_killed")  # nobody was blamed: every process lived on
    failed = run.events("collective_failed")  # the cut-off's reason, or a peer that gave up first closing its links
    assert {e["rank"] for e in failed} == {0, 1, 2, 3} and {e["gen"] for e in failed} == {0}, failed
    assert any("the collective is stuck" in e["error"] for e in failed), failed
    # the stuck dwells were the fault's, not samples: the timeout at the end stands on the healthy reductions (times
    # the back-off of the one cut-off)
    reduction = s["phase_timeouts"]["reduction"]
    assert reduction["backoff"] == 2 and reduction["p99_s"] < stuck["timeout_s"], reduction
    # the retry's regroup was timed (seen in the heartbeats of the 15 steps after it), but one is no distribution:
    # the next retry still has the fixed bound
    retry = s["phase_timeouts"]["recovery"]["kinds"]["retry"]
    assert retry["samples"] == 1 and not retry["calibrated"], s["phase_timeouts"]
    startup = s["phase_timeouts"]["startup"]["kinds"]["initial"]  # one start-up per rank of the first generation
    assert startup["samples"] == 4 and startup["calibrated"] and startup["timeout_s"] >= 0.5, s["phase_timeouts"]


@pytest.mark.parametrize("overrides, says", [
    (["heartbeat.phase_timeouts.floor_s=0.1"], "floor_s (0.1) must be at least 2 x heartbeat.interval_s"),
    (["heartbeat.interval_s=5"], "floor_s (2.0) must be at least 2 x heartbeat.interval_s (10)"),
    (["heartbeat.phase_timeouts.k=0.5"], "heartbeat.phase_timeouts.k=0.5 must be >= 1"),
    (["heartbeat.phase_timeouts.warmup_steps=0"], "warmup_steps=0 must be >= 1"),
    (["fault=hang_rank", "fault.hang=stall", "fault.during=recovery"], "hang=stall blocks the victim's training"),
    (["fault=kill_rank", "fault.hang=stall"], "fault.hang=stall is ignored by kind=kill_rank"),
    (["fault=kill_rank", "fault.step=3", "fault.during=reduction"], "during=reduction wedges the reduction of a step"),
    (["health.matmul_max_s=0"], "health.matmul_max_s=0 must be > 0"),
])
def test_bad_phase_timeout_health_and_hang_settings_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        validate(_compose("+recipe=gpt_tiny", *overrides))


def test_flashrecovery_heartbeats_come_with_a_floor_they_can_resolve():
    validate(_compose("+recipe=gpt_tiny", "heartbeat=flashrecovery"))


def test_a_phases_window_stays_sorted_as_its_oldest_dwells_leave():
    from runner.control.phase_timeouts import WINDOW, Dwells

    dwells, seen = Dwells(), []
    for i in range(3 * WINDOW):
        seconds = (i * 7919) % 1000 / 1000  # out of order, with repeats
        dwells.add(seconds)
        seen.append(seconds)
    window = seen[-WINDOW:]
    assert len(dwells) == WINDOW and dwells.ordered == sorted(window) and dwells.p99() == p99(window)
