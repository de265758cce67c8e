"""Per-phase hang timeouts calibrated from the run: how long a worker may stay in one (step, phase).

One fixed ``heartbeat.stall_timeout_s`` must be long enough for the slowest healthy phase of any job, so a hang
on a millisecond step waits as long as one on a minute-long checkpoint. Instead the controller measures, from the
heartbeats it already reads, how long each worker stays in one (step, phase) (the dwell), pools them per phase
over the run, and gives each phase the timeout ``max(floor_s, k x p99)`` of its newest ``WINDOW`` dwells once the
phase was seen at ``warmup_steps`` distinct steps; before that, ``stall_timeout_s``. The dwell is what the hang
rule itself compares (``runner.control.detection``), so the heartbeat's resolution is in both alike.

Judged are the phases in which a worker does its own work: ``compute`` (forward, backward, the update, callbacks;
also ``takeover``, NDB's extra micro-batch) and ``checkpoint`` (a snapshot or a checkpoint being taken). A rank
in the reduction, a rendezvous or a recovery waits for others: the one it waits for is the one judged (a rank
stuck in the reduction itself is the collective timeout's, ``launcher.collective_timeout_s``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

from runner.plumbing.events import EventLog

JUDGED = {"compute": "compute", "takeover": "compute", "checkpoint": "checkpoint"}  # worker phase -> timed phase
WINDOW = 1024  # the newest dwells a phase's p99 is taken over
MATERIAL = 0.2  # a timeout that moved by more than this fraction since it was last logged is logged again


def p99(values) -> float:
    """The nearest-rank 99th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class PhaseTimeouts:
    """Pure but for the event: fed each dwell that ended (``observe``), asked for a phase's timeout (``limit``)."""

    def __init__(self, hb, events: Optional[EventLog] = None) -> None:
        pt = hb.phase_timeouts
        self.enabled, self.k, self.floor_s, self.warmup_steps = pt.enabled, pt.k, pt.floor_s, pt.warmup_steps
        self.fallback_s = hb.stall_timeout_s
        self.events = events
        self.dwells: dict[str, deque] = {p: deque(maxlen=WINDOW) for p in set(JUDGED.values())}
        self.steps: dict[str, set[int]] = {p: set() for p in self.dwells}
        self.logged: dict[str, float] = {}  # phase -> the timeout last logged

    def observe(self, worker_phase: str, step: int, dwell_s: float) -> None:
        """A worker left (step, ``worker_phase``) after ``dwell_s`` seconds in it, as the controller saw it."""
        phase = JUDGED.get(worker_phase)
        if phase is None or not self.enabled:
            return
        self.dwells[phase].append(dwell_s)
        self.steps[phase].add(step)

    def limit(self, worker_phase: str) -> Optional[tuple[float, bool]]:
        """(timeout in seconds, calibrated) for a worker in ``worker_phase``; None: the phase is not judged."""
        phase = JUDGED.get(worker_phase)
        if phase is None:
            return None
        if not self.enabled or len(self.steps[phase]) < self.warmup_steps:
            return self.fallback_s, False
        return max(self.floor_s, self.k * p99(self.dwells[phase])), True

    def state(self) -> dict[str, dict]:
        """Each phase's timeout in effect and what it stands on (summary.json's ``phase_timeouts``)."""
        out = {}
        for phase, dwells in sorted(self.dwells.items()):
            timeout_s, calibrated = self.limit(phase) or (self.fallback_s, False)
            out[phase] = {"timeout_s": round(timeout_s, 4), "calibrated": calibrated,
                          "p99_s": round(p99(dwells), 4) if dwells else None, "dwells": len(dwells),
                          "steps": len(self.steps[phase])}
        return out

    def publish(self) -> None:
        """Log ``phase_timeouts`` when a phase's timeout became calibrated or moved materially since last logged."""
        if not self.enabled or self.events is None:
            return
        state = self.state()
        moved = [p for p, s in state.items() if s["calibrated"] and (
            p not in self.logged or abs(s["timeout_s"] - self.logged[p]) > MATERIAL * self.logged[p])]
        if moved:
            self.logged.update({p: state[p]["timeout_s"] for p in moved})
            self.events.emit("phase_timeouts", changed=moved, timeouts=state)


def config_problems(cfg) -> list[str]:
    """``heartbeat.phase_timeouts`` against the heartbeat it is observed with, checked at config time."""
    hb = cfg.heartbeat
    pt = hb.phase_timeouts
    if pt.enabled and pt.floor_s < 2 * hb.interval_s:
        return [f"heartbeat.phase_timeouts.floor_s ({pt.floor_s}) must be at least 2 x heartbeat.interval_s "
                f"({2 * hb.interval_s:g}): a phase's dwell is seen through heartbeats, so a shorter timeout could "
                "fire on a healthy worker between two beats. Raise floor_s, or set heartbeat.phase_timeouts.enabled="
                "false to judge hangs by stall_timeout_s alone."]
    return []
