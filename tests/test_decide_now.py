"""When the controller decides: at once on conclusive evidence (an exit an agent saw, nothing else uncertain),
else when the decide window closes, and which rule closed each decision (``decide_reason``).

The controller runs without processes, as in tests/test_control_state.py: a real ``HashStore`` carries the
protocol, the fleet records what is started and signalled, and the test plays the workers' side. The window
is long (5 s), so a decision in the first round can only be the early one.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from runner.control.controller import READY_POLL_S, Controller
from runner.plumbing import protocol
from runner.report.summary import recovery_entry
from tests.test_control_state import RecordedFleet, _round
from tests.test_control_state import _start as start_controller

WINDOW_S = 5.0
BASE = ["+recipe=gpt_tiny", "logger=none", "runner.console_events=false", "parallel.nodes=2",
        "parallel.procs_per_node=2", "heartbeat.interval_s=1", f"heartbeat.decide_window_s={WINDOW_S}",
        "ft=flashrecovery"]


def _start(tmp_path: Path, *overrides: str) -> tuple[Controller, RecordedFleet]:
    return start_controller(tmp_path, *overrides, base=BASE)


def _beat(ctl: Controller, wids, age_s: float = 0.0) -> None:
    """Heartbeats written ``age_s`` seconds ago."""
    for wid in wids:
        protocol.set_json(ctl.store, f"hb/{wid}", {"seq": 1, "step": 3, "phase": "compute", "rss": 0,
                                                   "t": time.time() - age_s})


def _decided(tmp_path: Path) -> list[tuple]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [(e["action"], e["victims"], e["decide_reason"]) for e in map(json.loads, lines)
            if e["kind"] == "recovery_decided"]


def test_an_exit_with_everyone_else_beating_is_decided_at_once(tmp_path):
    ctl, fleet = _start(tmp_path)
    _beat(ctl, [0, 1, 3])
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    assert _decided(tmp_path) == [("restart_rank", [2], "conclusive_exit")]
    rec = ctl.record.recoveries[0]
    assert rec.decide_reason == "conclusive_exit" and rec.t_decide - rec.t_detect < WINDOW_S
    assert recovery_entry(rec, [], [])["decide_reason"] == "conclusive_exit"  # summary.json shows it too


def test_with_decide_at_once_off_the_same_exit_waits_for_the_window(tmp_path):
    ctl, fleet = _start(tmp_path, "heartbeat.decide_at_once=false")
    _beat(ctl, [0, 1, 3])
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    assert _decided(tmp_path) == []
    _round(ctl, ahead_s=WINDOW_S)
    assert _decided(tmp_path) == [("restart_rank", [2], "window")]


def test_a_member_whose_heartbeat_is_old_keeps_the_window(tmp_path):
    ctl, fleet = _start(tmp_path)
    _beat(ctl, [0, 1])
    _beat(ctl, [3], age_s=2.5)  # more than two intervals ago: its state is uncertain
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    assert _decided(tmp_path) == []
    _round(ctl, ahead_s=WINDOW_S)
    assert _decided(tmp_path) == [("restart_rank", [2], "window")]


def test_a_report_proves_a_member_alive(tmp_path):
    ctl, fleet = _start(tmp_path)
    _beat(ctl, [0, 1])
    _beat(ctl, [3], age_s=2.5)
    protocol.report(ctl.store, {"wid": 3, "gen": 0, "reason": "collective failed"})
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    assert _decided(tmp_path) == [("restart_rank", [2], "conclusive_exit")]


def test_a_silent_agent_keeps_the_window(tmp_path):
    ctl, fleet = _start(tmp_path)
    _beat(ctl, [0, 1, 3])
    fleet.lost.add(0)  # node 0's agent stopped beating (not yet long enough to be called lost)
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    assert _decided(tmp_path) == []


def test_a_steps_kills_are_decided_together_when_their_exits_arrive_one_by_one(tmp_path):
    ctl, fleet = _start(tmp_path, "fault.kind=kill_rank", "fault.rank=1", "fault.step=3",
                        "+fault.extra=[{kind: kill_rank, rank: 2, step: 3}]")
    _beat(ctl, [0, 3])
    protocol.set_json(ctl.store, "fault/hit/0", {"wid": 1, "step": 3})
    protocol.set_json(ctl.store, "fault/hit/1", {"wid": 2, "step": 3})
    _round(ctl)
    assert fleet.signals == [(1, signal.SIGKILL), (2, signal.SIGKILL)]
    ctl.queue.put(("exit", 1, -9, time.time()))
    _round(ctl)
    assert _decided(tmp_path) == []  # rank 2 was killed with it: its exit is on its way
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    assert _decided(tmp_path) == [("restart_rank", [1, 2], "conclusive_exit")]


def test_a_kill_beside_a_node_loss_waits_for_the_window(tmp_path):
    """The lost node's workers never report an exit: the kill on the other node must not be decided alone
    before the window closes."""
    ctl, fleet = _start(tmp_path, "parallel.spares=2", "ft=[flashrecovery,deadpool]", "fault.kind=kill_node",
                        "fault.node=1", "fault.step=3", "+fault.extra=[{kind: kill_rank, rank: 0, step: 3}]")
    _beat(ctl, [0, 1, 2, 3])
    protocol.set_json(ctl.store, "fault/hit/0", {"wid": 2, "step": 3})
    protocol.set_json(ctl.store, "fault/hit/1", {"wid": 0, "step": 3})
    _round(ctl)
    assert fleet.lost == {1} and (0, signal.SIGKILL) in fleet.signals
    ctl.queue.put(("exit", 0, -9, time.time()))
    _round(ctl)
    assert _decided(tmp_path) == []


def test_a_hang_kill_keeps_the_window(tmp_path):
    ctl, fleet = _start(tmp_path)
    _beat(ctl, [0, 1, 3])
    ctl.detector.kill_hung(ctl.members.workers[2], "test: heartbeats missed")
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    assert _decided(tmp_path) == []
    _round(ctl, ahead_s=WINDOW_S)
    assert [d[2] for d in _decided(tmp_path)] == ["window"]


def test_a_transient_is_decided_once_everyone_proved_alive(tmp_path):
    ctl, fleet = _start(tmp_path)
    protocol.report(ctl.store, {"wid": 1, "gen": 0, "reason": "collective failed"})
    _round(ctl)
    _round(ctl, ahead_s=WINDOW_S)
    assert _decided(tmp_path) == []  # the window closed, but nobody proved alive yet
    _beat(ctl, range(4))
    _round(ctl, heartbeats=True, ahead_s=WINDOW_S + 1)
    assert _decided(tmp_path) == [("retry", [], "proof_of_life")]


def test_the_loop_waits_briefly_only_while_a_decision_is_due_or_a_replacement_starts(tmp_path):
    """The loop's wait for the next exit (``Controller._wait_s``): ``idle_s`` with nothing open, no longer than
    until a due decision, and ``READY_POLL_S`` while the recovery waits for its replacement's ready key."""
    ctl, fleet = _start(tmp_path, "heartbeat.decide_at_once=false")
    idle_s = 0.05
    assert ctl._wait_s(time.monotonic(), idle_s) == idle_s
    _beat(ctl, [0, 1, 3])
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    due = ctl.incidents.decide_at
    assert due is not None and ctl._wait_s(due - 10 * idle_s, idle_s) == idle_s
    assert ctl._wait_s(due - 0.01, idle_s) == pytest.approx(0.01) and ctl._wait_s(due + 1, idle_s) == 0.0
    _round(ctl, ahead_s=WINDOW_S)  # decided: restart_rank, a replacement spawned
    replacement = max(ctl.members.workers)
    assert ctl.members.workers[replacement].role == "joiner"
    assert ctl._wait_s(time.monotonic(), idle_s) == READY_POLL_S
    ctl.store.set(f"ready/{replacement}", "1")
    _round(ctl)
    assert ctl.incidents.active is None and ctl._wait_s(time.monotonic(), idle_s) == idle_s
