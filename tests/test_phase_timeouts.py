"""Per-phase hang timeouts calibrated from the run (``runner.control.phase_timeouts``): the rule alone, then real runs
where a hang on a fast step is found in a fraction of ``stall_timeout_s`` and a slow but steady phase is never one."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.config.validate import validate
from runner.control.phase_timeouts import MATERIAL, PhaseTimeouts, p99
from tests.conftest import TWO_BY_TWO, run_cli
from tests.test_config import _compose
from tests.test_flashrecovery import FR, assert_exact


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, kind: str, **fields) -> None:
        self.emitted.append((kind, fields))


def timeouts(events=None, **pt) -> PhaseTimeouts:
    hb = OmegaConf.create({"stall_timeout_s": 10.0, "phase_timeouts": {"enabled": True, "k": 4.0, "floor_s": 0.5,
                                                                       "warmup_steps": 3, **pt}})
    return PhaseTimeouts(hb, events)


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


def test_disabled_every_judged_phase_waits_stall_timeout_s():
    t = timeouts(enabled=False)
    for step in range(50):
        t.observe("compute", step, 0.01)
    assert t.limit("compute") == (10.0, False) and t.limit("checkpoint") == (10.0, False)


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


CALIBRATED = ["heartbeat.phase_timeouts.warmup_steps=5", "heartbeat.phase_timeouts.floor_s=0.5"]
STALL_TIMEOUT_S = 10.0  # heartbeat.stall_timeout_s, the default


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
    logged = [e["timeouts"]["compute"] for e in run.events("phase_timeouts") if e["t"] < killed["t"]]
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


@pytest.mark.parametrize("overrides, says", [
    (["heartbeat.phase_timeouts.floor_s=0.1"], "floor_s (0.1) must be at least 2 x heartbeat.interval_s"),
    (["heartbeat.interval_s=5"], "floor_s (2.0) must be at least 2 x heartbeat.interval_s (10)"),
    (["heartbeat.phase_timeouts.k=0.5"], "heartbeat.phase_timeouts.k=0.5 must be >= 1"),
    (["heartbeat.phase_timeouts.warmup_steps=0"], "warmup_steps=0 must be >= 1"),
    (["fault=hang_rank", "fault.hang=stall", "fault.during=recovery"], "hang=stall blocks the victim's training"),
    (["fault=kill_rank", "fault.hang=stall"], "fault.hang=stall is ignored by kind=kill_rank"),
    (["health.matmul_max_s=0"], "health.matmul_max_s=0 must be > 0"),
])
def test_bad_phase_timeout_health_and_hang_settings_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        validate(_compose("+recipe=gpt_tiny", *overrides))


def test_flashrecovery_heartbeats_come_with_a_floor_they_can_resolve():
    validate(_compose("+recipe=gpt_tiny", "heartbeat=flashrecovery"))
