"""Incidents: symptoms gathered into recoveries, and when the open recovery is due for a decision.

The first symptom opens a recovery and starts the decide window (``heartbeat.decide_window_s``), so
that the exits of one fault are decided together. An exit a node agent saw is looked at at once: when
that evidence is already conclusive (``Detector.conclusive_exit``) the decision does not wait for the
window to close (unless ``heartbeat.decide_at_once`` is off). Faults the run injects note their victims
here, for the record of the recovery they cause and so that a decision waits for all of their exits.
"""

from __future__ import annotations

import time
from typing import Optional

from runner.control.records import Recovery, RunRecord
from runner.plumbing.events import EventLog

DETAIL_KEYS = ("wid", "code", "node", "why", "reason", "gen")


def short(details: dict) -> dict:
    """The details of a symptom that an event repeats."""
    return {k: v for k, v in details.items() if k in DETAIL_KEYS}


class Incidents:
    """The open recovery (if any), every recovery so far (in ``record``), and the decision's due time."""

    def __init__(self, record: RunRecord, events: EventLog, decide_window_s: float) -> None:
        self.record, self.events, self.decide_window_s = record, events, decide_window_s
        self.active: Optional[Recovery] = None
        self.decide_at: Optional[float] = None  # when the open recovery is next looked at (monotonic)
        self.window_ends = 0.0  # when the decide window of the symptoms not decided yet closes (monotonic)
        self.held_by = ""  # the rule that kept a due decision waiting past the window, if one did
        self.opened = 0  # recoveries opened so far (ids are 0, 1, ...)
        self.injected_victims: set[int] = set()  # killed by an injected fault, for the next recovery's record

    def symptom(self, kind: str, **details) -> None:
        """Add a symptom to the open recovery, opening one if none is; ignored once the run is over."""
        if self.record.status != "running":
            return
        if self.active is None:
            self.active = Recovery(id=self.opened, t_detect=time.time(), t_detect_mono=time.monotonic())
            self.opened += 1
            self.record.recoveries.append(self.active)
            self.events.emit("fault_detected", recovery=self.active.id, symptom=kind, **short(details))
        self.active.symptoms.append({"kind": kind, **details})
        now = time.monotonic()
        if self.decide_at is None:  # the first symptom since the last decision opens the window
            self.window_ends = now + self.decide_window_s
            self.decide_at, self.held_by = self.window_ends, ""
        if kind == "exit":
            self.decide_at = now  # an exit the agent saw may settle it: look this round, not at the window's end

    def planned(self, kind: str, **details) -> Recovery:
        """Open a recovery the controller itself starts (a straggler's hand-over): decided at once, no window."""
        rec = Recovery(id=self.opened, t_detect=time.time(), t_detect_mono=time.monotonic())
        self.opened += 1
        self.record.recoveries.append(rec)
        self.active = rec
        rec.symptoms.append({"kind": kind, **details})
        self.events.emit("fault_detected", recovery=rec.id, symptom=kind, **short(details))
        return rec

    def hold(self, until: float, rule: str = "") -> None:
        """Look at the open recovery again at ``until``; ``rule``: what keeps the decision waiting past the
        window (recorded as the rule that closed the decision once it is made)."""
        self.decide_at = until
        if rule:
            self.held_by = rule

    def decide_reason(self, now: float) -> str:
        """Which rule closed the decision made now: ``conclusive_exit`` before the window closed, the rule
        that held it past the window (``proof_of_life``, ``arrivals``), else ``window``."""
        if now < self.window_ends:
            return "conclusive_exit"
        return self.held_by or "window"

    def not_needed(self, reason: str) -> None:
        """The open recovery needs no action after all: it leaves the record."""
        rec = self.active
        assert rec is not None  # called while deciding the open recovery
        self.events.emit("recovery_not_needed", recovery=rec.id, reason=reason)
        self.record.recoveries.remove(rec)
        self.active = None

    def take_injected(self) -> set[int]:
        victims, self.injected_victims = self.injected_victims, set()
        return victims

    def last_acted(self, before: Recovery) -> Optional[Recovery]:
        """The newest recovery other than ``before`` that was decided."""
        return next((r for r in reversed(self.record.recoveries) if r is not before and r.action), None)
