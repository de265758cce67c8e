"""The controller's console: each recovery as one readable line, when its full world is back.

The controller's events (``events.jsonl``) are the source; this turns the few a reader follows into
sentences, e.g. ``step 20: rank 2 killed (SIGKILL) -> restarted in place; full world ready in 0.21 s
(detect+decide+replace), 0 steps lost``. The line names its interval in the phases of summary.json's RTO
(which goes on to the full world's first commit: + rebuild + restore), so the two never read as two RTOs.
A recovery's fault, decision and complete generation arrive as separate events, so the console gathers them
and prints once the recovery closes. The exact RTO phases and RPO measured from
the workers' commits are in ``summary.json`` and the summary block at the end.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field
from typing import Optional, TextIO

from runner.control.stragglers import straggler_line

# What each recovery action did, as the line says it.
DONE = {
    "retry": "group rebuilt, step retried",
    "restart_rank": "restarted in place",
    "swap_spare": "warm spare took over",
    "takeover": "neighbours took over its work",
    "restart_all": "every rank restarted from the newest flash snapshot",
}
# Actions that restore from a live replica: the struck step is redone, no committed step is lost.
FROM_LIVE_STATE = {"retry", "restart_rank", "swap_spare", "takeover"}
READY_PHASES = "detect+decide+replace"  # what the line's time covers, in summary.json's RTO phases
CLEAR_LINE = "\r\x1b[K"  # on a terminal: erase the progress bar's line; the bar redraws below


@dataclass
class _Open:
    """What the console knows of a recovery that has not closed yet."""

    t_fault: Optional[float] = None
    step: Optional[int] = None
    fault: str = ""
    code: Optional[int] = None
    fault_class: str = ""
    action: str = ""
    victims: list = field(default_factory=list)


class RecoveryConsole:
    """Receives every controller event (``EventLog``'s echo) and prints a line per recovery, run failure,
    recovery found unnecessary and straggler found. ``progress_bar``: rank 0's bar shares this output, and its
    line has no end until the bar closes, so a line printed meanwhile starts on a line of its own."""

    def __init__(self, progress_bar: bool, out: TextIO = sys.stdout) -> None:
        self.out, self.progress_bar = out, progress_bar
        self.open: dict[int, _Open] = {}
        self._injected = _Open()  # the newest injected fault, until a recovery claims it

    def __call__(self, event: dict) -> None:
        kind = event["kind"]
        if kind == "fault_injected":
            self._injected = _Open(t_fault=event.get("t_fault", event["t"]), step=event.get("at_step"),
                                   fault=event["fault"], victims=list(event.get("victims", [])))
        elif kind == "fault_detected":
            rec = self._recovery(event["recovery"], event["t"])
            if rec.code is None and event.get("symptom") == "exit":
                rec.code = event.get("code")
        elif kind == "recovery_decided":
            rec = self._recovery(event["recovery"], event["t"])
            rec.fault_class, rec.action = event.get("fault_class", event.get("fault", "")), event["action"]
            rec.victims = list(event.get("victims", rec.victims))
        elif kind == "generation" and event.get("recovery", -1) in self.open and not event.get("pending"):
            self._print(recovery_line(self.open.pop(event["recovery"]), event["t"]))
        elif kind == "recovery_not_needed":
            self.open.pop(event["recovery"], None)
            self._print(f"recovery {event['recovery']} not needed: {event.get('reason', '')}")
        elif kind == "straggler_detected":
            self._print(straggler_line(event))
        elif kind == "run_failed":
            self._print(f"run failed: {event.get('error', '')}")

    def _recovery(self, recovery: int, t_detect: float) -> _Open:
        """The open recovery ``recovery``; a new one claims the newest injected fault."""
        if recovery not in self.open:
            rec, self._injected = self._injected, _Open()
            if rec.t_fault is None:  # a fault nobody injected: the clock starts at its detection
                rec.t_fault = t_detect
            self.open[recovery] = rec
        return self.open[recovery]

    def _print(self, line: str) -> None:
        lead = CLEAR_LINE if self.out.isatty() else "\n" if self.progress_bar else ""
        print(f"{lead}[runner] {line}", file=self.out, flush=True)


def recovery_line(rec: _Open, t_back: float) -> str:
    """``step 20: rank 2 killed (SIGKILL) -> restarted in place; full world ready in 0.21 s (detect+decide+replace),
    0 steps lost``: fault to the complete generation's publication, the first three of the RTO's phases."""
    where = f"step {rec.step}: " if rec.step is not None and rec.step >= 0 else ""
    done = DONE.get(rec.action, rec.action or "recovered")
    lost = "0 steps lost" if rec.action in FROM_LIVE_STATE else "steps lost in summary.json"
    back = (f"full world ready in {t_back - rec.t_fault:.2f} s ({READY_PHASES})" if rec.t_fault is not None
            else "full world ready")
    return f"{where}{what_happened(rec)} -> {done}; {back}, {lost}"


def what_happened(rec: _Open) -> str:
    ranks = ", ".join(str(r) for r in rec.victims)
    who = f"rank{'s' if len(rec.victims) != 1 else ''} {ranks}" if ranks else "a rank"
    if rec.fault == "kill_node":
        return f"node lost ({who})"
    if rec.fault in ("kill_all", "wipe_shm", "corrupt_snapshot"):
        return f"every rank killed ({rec.fault})"
    if rec.fault and rec.fault != "kill_rank":  # a hang, say: its worker is killed only to end it
        return f"{(rec.fault_class or rec.fault).replace('_', ' ')} on {who} (injected {rec.fault})"
    if rec.code is not None and rec.code < 0:
        return f"{who} killed ({_signal_name(-rec.code)})"
    if rec.code is not None:
        return f"{who} exited with code {rec.code}"
    return f"{(rec.fault_class or rec.fault or 'fault').replace('_', ' ')} on {who}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
