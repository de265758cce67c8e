"""Per-phase hang timeouts calibrated from the run: how long a worker, or a whole generation, may stay in one phase.

One fixed ``heartbeat.stall_timeout_s`` must be long enough for the slowest healthy phase of any job, so a hang
on a millisecond step waits as long as one on a minute-long checkpoint. Instead the controller measures, from the
heartbeats it already reads, how long each worker stays in one (step, phase) (the dwell), pools them per phase
over the run, and gives each phase the timeout ``max(floor_s, k x p99)`` of its newest ``WINDOW`` dwells once the
phase was seen at ``warmup_steps`` distinct steps; before that, the phase's fixed bound. The dwell is what the
rules themselves compare (``runner.control.detection``), so the heartbeat's resolution is in both alike.

* ``compute`` (forward, backward, the update, callbacks; also ``takeover``, NDB's extra micro-batch) and
  ``checkpoint``: a worker's own work, judged per worker (before calibration: ``stall_timeout_s``).
* ``reduction`` (the gradient all-reduce, ``reduce``; ZeRO-1's parameter all-gather, ``sync``): one rank waiting
  there waits for a peer that still computes, which is the peer's rule; only when every member of the generation
  sits in the same step's reduction past the timeout is the collective itself stuck (before calibration:
  ``launcher.collective_timeout_s``, the workers' own bound).
* ``startup``: from a worker's spawn to its first heartbeat, by the role it was started in (an initial rank, a
  replacement that proves its host first, ...): ``max(floor_s, k x the slowest start-up of that role so far)``
  for a worker spawned after ``KEYED_SAMPLES`` were seen (before, and for the rest of the wave that gave them:
  ``launcher.start_timeout_s``). The slowest, not a p99: there are few.
* ``recovery``: from the publication of a recovery's complete generation until every member trains in it, by the
  recovery's action (a retry regroups in milliseconds, a restart of every rank loads a checkpoint):
  ``max(floor_s, k x the slowest regroup of that action so far)`` once ``KEYED_SAMPLES`` were seen (before:
  ``launcher.recovery_timeout_s``, the workers' own bound).

The reduction, start-up and recovery timeouts double with every time their rule acted (``acted``: a generation cut
off, a start-up killed), and the dwells of a generation cut off are not samples: a reduction, start-up or regroup that
became slower for good (a degraded network, a loaded host) is cut off or killed a few times, never for ever, while one
truly stuck is still ended long before the fixed bound.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Optional

from runner.plumbing.events import EventLog

JUDGED = {"compute": "compute", "takeover": "compute", "checkpoint": "checkpoint"}  # a worker's own work, per worker
GROUP = {"reduce": "reduction", "sync": "reduction"}  # worker phase -> timed phase judged over the whole generation
WINDOW = 1024  # the newest dwells a phase's p99 is taken over
MATERIAL = 0.2  # a timeout that moved by more than this fraction since it was last logged is logged again
KEYED_SAMPLES = 3  # start-ups of one role, regroups of one action: one is no distribution (a second start-up on a
# busier host can take several times the first), so a kind is calibrated once this many were seen


def p99(values) -> float:
    """The nearest-rank 99th percentile."""
    return _p99_of_sorted(sorted(values))


def _p99_of_sorted(ordered: list) -> float:
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class Dwells:
    """A phase's newest ``WINDOW`` dwells, kept sorted as they come: the controller asks for the p99 of each judged
    worker's phase on every heartbeat round (thousands of ranks), so it is read, not sorted, each time."""

    def __init__(self) -> None:
        self.window: deque = deque()
        self.ordered: list[float] = []

    def add(self, seconds: float) -> None:
        if len(self.window) == WINDOW:
            del self.ordered[bisect.bisect_left(self.ordered, self.window.popleft())]
        self.window.append(seconds)
        bisect.insort(self.ordered, seconds)

    def __len__(self) -> int:
        return len(self.window)

    def p99(self) -> float:
        return _p99_of_sorted(self.ordered)


class PhaseTimeouts:
    """Pure but for the event: fed each dwell, start-up and regroup that ended (``observe``, ``observe_startup``,
    ``observe_recovery``), asked for a phase's timeout (``limit``, ``startup_limit``, ``recovery_limit``)."""

    def __init__(self, hb, launcher, events: Optional[EventLog] = None, group_rules: bool = True) -> None:
        """``group_rules``: the generation-wide rules (reduction, recovery) can act, i.e. a waiting member gives its
        collective up when the controller cuts the generation off (gloo; an NCCL wait is not sliced)."""
        pt = hb.phase_timeouts
        self.enabled, self.k, self.floor_s, self.warmup_steps = pt.enabled, pt.k, pt.floor_s, pt.warmup_steps
        self.group_rules = group_rules and pt.enabled
        self.fixed = {"compute": hb.stall_timeout_s, "checkpoint": hb.stall_timeout_s,
                      "reduction": launcher.collective_timeout_s, "startup": launcher.start_timeout_s,
                      "recovery": launcher.recovery_timeout_s}
        self.events = events
        self.dwells: dict[str, Dwells] = {p: Dwells() for p in (*set(JUDGED.values()), "reduction")}
        self.steps: dict[str, set[int]] = {p: set() for p in self.dwells}
        self.slowest: dict[str, dict[str, tuple[float, int]]] = {"startup": {}, "recovery": {}}  # kind -> (s, n)
        self.calibrated_at: dict[str, float] = {}  # a start-up role -> when its KEYED_SAMPLES-th start-up was seen
        self.backoff = {"reduction": 1, "startup": 1, "recovery": 1}  # 2 ** the times each rule acted
        self.logged: dict[str, float] = {}  # phase (or phase/kind) -> the timeout last logged

    # -- what was seen -----------------------------------------------------------------------------
    def observe(self, worker_phase: str, step: int, dwell_s: float) -> None:
        """A worker left (step, ``worker_phase``) after ``dwell_s`` seconds in it, as the controller saw it."""
        phase = JUDGED.get(worker_phase) or GROUP.get(worker_phase)
        if phase is None or not self.enabled:
            return
        self.dwells[phase].add(dwell_s)
        self.steps[phase].add(step)

    def observe_startup(self, role: str, seconds: float, at: float = 0.0) -> None:
        """A worker started as ``role`` beat for the first time ``seconds`` after it was spawned, seen at ``at``
        (monotonic)."""
        self._slowest("startup", role, seconds)
        seen = self.slowest["startup"].get(role)
        if seen is not None and seen[1] == KEYED_SAMPLES:
            self.calibrated_at[role] = at

    def observe_recovery(self, action: str, seconds: float) -> None:
        """Every member of the complete generation a recovery by ``action`` published trained in it ``seconds``
        after its publication."""
        self._slowest("recovery", action, seconds)

    def acted(self, phase: str) -> None:
        """The calibrated rule of ``phase`` (reduction, recovery: a generation cut off; startup: a worker killed)
        acted: its timeouts double from now on."""
        self.backoff[phase] *= 2

    def _slowest(self, phase: str, kind: str, seconds: float) -> None:
        if self.enabled:
            slowest, n = self.slowest[phase].get(kind, (0.0, 0))
            self.slowest[phase][kind] = (max(slowest, seconds), n + 1)

    # -- the timeouts in effect ---------------------------------------------------------------------
    def limit(self, worker_phase: str) -> Optional[tuple[float, bool]]:
        """(timeout in seconds, calibrated) for a worker in ``worker_phase`` judged on its own; None: not judged."""
        phase = JUDGED.get(worker_phase)
        return None if phase is None else self._pooled(phase)

    def reduction_limit(self) -> Optional[float]:
        """The calibrated timeout of a whole generation's stay in one step's reduction; None: not calibrated (or the
        rule cannot act), so the collective's own timeout bounds it."""
        timeout_s, calibrated = self._pooled("reduction")
        return timeout_s * self.backoff["reduction"] if calibrated and self.group_rules else None

    def startup_limit(self, role: str, spawned_at: float = math.inf) -> tuple[float, bool]:
        """(timeout, calibrated) from the spawn of a worker started as ``role`` at ``spawned_at`` (monotonic) to its
        first heartbeat. A worker spawned before its role was calibrated keeps the fixed bound: it started in the
        same wave as the samples, and on a loaded host the last of a wave can take several times the others."""
        timeout_s, calibrated = self._keyed("startup", role)
        if calibrated and self.calibrated_at.get(role, math.inf) <= spawned_at:
            return timeout_s * self.backoff["startup"], True
        return self.fixed["startup"], False

    def recovery_limit(self, action: str) -> Optional[float]:
        """The calibrated timeout from the publication of a complete generation by a recovery of ``action`` until
        every member trains in it; None: not calibrated (or the rule cannot act): the workers' own bounds."""
        timeout_s, calibrated = self._keyed("recovery", action)
        return timeout_s * self.backoff["recovery"] if calibrated and self.group_rules else None

    def _pooled(self, phase: str) -> tuple[float, bool]:
        if not self.enabled or len(self.steps[phase]) < self.warmup_steps:
            return self.fixed[phase], False
        return max(self.floor_s, self.k * self.dwells[phase].p99()), True

    def _keyed(self, phase: str, kind: str) -> tuple[float, bool]:
        seen = self.slowest[phase].get(kind)
        if not self.enabled or seen is None or seen[1] < KEYED_SAMPLES:
            return self.fixed[phase], False
        return max(self.floor_s, self.k * seen[0]), True

    # -- what is logged -----------------------------------------------------------------------------
    def state(self) -> dict[str, dict]:
        """Each phase's timeout in effect and what it stands on (summary.json's ``phase_timeouts``). ``startup`` and
        ``recovery`` carry one entry per role or action seen under ``kinds``; their own ``timeout_s`` is the fixed
        bound, which holds for a kind not seen yet."""
        out: dict[str, dict] = {}
        for phase, dwells in sorted(self.dwells.items()):
            timeout_s, calibrated = self._pooled(phase)
            out[phase] = {"timeout_s": round(timeout_s, 4), "calibrated": calibrated,
                          "p99_s": round(dwells.p99(), 4) if dwells else None, "dwells": len(dwells),
                          "steps": len(self.steps[phase])}
        reduction_s = self.reduction_limit()
        out["reduction"].update(timeout_s=round(reduction_s, 4) if reduction_s is not None else self.fixed["reduction"],
                                calibrated=reduction_s is not None, backoff=self.backoff["reduction"])
        for phase, kinds in self.slowest.items():
            out[phase] = {"timeout_s": self.fixed[phase], "calibrated": False, "kinds": {}}
            for kind, (slowest, n) in sorted(kinds.items()):
                if phase == "recovery":
                    limit = self.recovery_limit(kind)
                    timeout_s, calibrated = (limit, True) if limit is not None else (self.fixed[phase], False)
                else:
                    timeout_s, calibrated = self.startup_limit(kind)
                out[phase]["kinds"][kind] = {"timeout_s": round(timeout_s, 4), "calibrated": calibrated,
                                             "slowest_s": round(slowest, 4), "samples": n}
            out[phase]["calibrated"] = any(e["calibrated"] for e in out[phase]["kinds"].values())
        out["startup"]["backoff"], out["recovery"]["backoff"] = self.backoff["startup"], self.backoff["recovery"]
        return out

    def publish(self) -> None:
        """Log ``phase_timeouts`` when a phase's timeout (one of a role's or an action's) became calibrated or moved
        materially since last logged; ``changed`` names the phases."""
        if not self.enabled or self.events is None:
            return
        state = self.state()
        values = {p: s["timeout_s"] for p, s in state.items() if "kinds" not in s and s["calibrated"]}
        values |= {f"{p}/{kind}": e["timeout_s"] for p, s in state.items() for kind, e in s.get("kinds", {}).items()
                   if e["calibrated"]}
        moved = [key for key, t in values.items()
                 if key not in self.logged or abs(t - self.logged[key]) > MATERIAL * self.logged[key]]
        if moved:
            self.logged.update({key: values[key] for key in moved})
            self.events.emit("phase_timeouts", changed=sorted({key.split("/")[0] for key in moved}), timeouts=state)


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
