"""Straggler detection: the rank, host or link the synchronous job keeps waiting for.

Every worker measures three numbers per committed step (``runner.training.commit``) and its heartbeat
carries the newest ones to the controller (``runner.callbacks.heartbeat``), so the training thread pays no store
round trip for them:

* ``compute``: the rank's own work between the end of its previous reduction and the start of this one
  (data, forward, backward, optimizer update, callbacks), less the time spent inside collective calls;
* ``wait``: the time spent in the step's collectives (the gradient reduction, ZeRO-1's parameter sync);
* ``link``: the part of ``wait`` spent in this rank's own collective launches, before its data is in
  flight: the sending side of its links.

A step is judged once every live rank reported it. A rank's peers are the ranks doing the same work
(with tp or pp > 1: the other DP replicas of its TP rank and pipeline stage). A rank is slow at a step
when its compute exceeds ``factor`` x the median of its peers' (and by at least ``min_excess_s``, so that the noise of a
millisecond step is no straggler); its link is slow when its ``link`` time exceeds ``factor`` x the
median of its peers' by as much, and its wait is not explained by a slower peer's compute (the wait
less the gap to the slowest compute is over ``min_excess_s``). After ``window_steps`` consecutive slow
steps the rank is a straggler: kind ``host`` when every rank of its host is one (and the job has other
hosts), else ``rank``; or kind ``link``. Each (kind, rank) is reported once per run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Optional

from runner.control.decision import Decision
from runner.control.records import Worker
from runner.planning.topology import Topology
from runner.plumbing.events import EventLog

KINDS = ("rank", "host", "link")
FIRST_JUDGED_STEP = 3  # a run's first steps carry one-time costs (lazy connections, allocations) unevenly: not judged


@dataclass(frozen=True)
class Timing:
    """One rank's numbers for one committed step, in seconds."""

    compute: float
    wait: float
    link: float


@dataclass
class Finding:
    """A straggler: ``ranks`` are logical ranks (a host finding names all of the host's)."""

    kind: str  # rank | host | link
    rank: int
    host: int
    ranks: list[int]
    factor: float  # the median ratio over the window: its compute (link) time / the peers' median
    steps: tuple[int, int]  # the window's first and last step
    evidence: dict = field(default_factory=dict)


@dataclass
class _Streak:
    """Consecutive slow steps of one rank for one kind, with their numbers."""

    start: int = -1
    ratios: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)
    peers: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)

    def add(self, step: int, ratio: float, own: float, peers: float, wait: float) -> None:
        if not self.ratios:
            self.start = step
        self.ratios.append(ratio)
        self.own.append(own)
        self.peers.append(peers)
        self.waits.append(wait)

    def __len__(self) -> int:
        return len(self.ratios)


class StragglerJudge:
    """Pure: fed the workers' timings (``add``) and judged at the steps every expected rank reported (``judge``)."""

    def __init__(self, factor: float, window_steps: int, min_excess_s: float,
                 role: Callable[[int], Hashable] = lambda rank: 0, first_step: int = 0) -> None:
        """``role(rank)``: ranks of one role do the same work (with tp or pp > 1: the same TP rank and pipeline
        stage), so only they are each other's peers; steps before ``first_step`` are not judged."""
        self.factor, self.window, self.min_excess_s = factor, window_steps, min_excess_s
        self.first_step = first_step
        self.role = role
        self.steps: dict[int, dict[int, Timing]] = {}  # step -> logical rank -> its timing
        self.hosts: dict[int, int] = {}  # logical rank -> the host it was last measured on
        self.latest: dict[int, int] = {}  # logical rank -> the newest step it timed
        self.judged_upto = -1
        self.streaks: dict[tuple[str, int], _Streak] = {}
        self.reported: set[tuple[str, int]] = set()

    def add(self, rank: int, host: int, records: list) -> None:
        """A heartbeat's ``[step, compute, wait, link]`` records (it repeats the newest few: kept once)."""
        self.hosts[rank] = host
        if records:
            self.latest[rank] = max(self.latest.get(rank, -1), int(records[-1][0]))
        for step, compute, wait, link in records:
            if step > self.judged_upto:
                self.steps.setdefault(int(step), {})[rank] = Timing(compute, wait, link)

    def pause(self) -> None:
        """The world is not whole (a recovery, neighbours covering a rank): forget the timings and the streaks,
        since a rank covering another's work is slow for a reason."""
        self.judged_upto = max([self.judged_upto, *(s for s in self.steps)])
        self.steps.clear()
        self.streaks.clear()
        self.latest.clear()

    def judge(self, expected: set[int]) -> list[Finding]:
        """Judge every step up to the oldest of the expected ranks' newest timed steps: a
        step some expected rank did not report (a lost beat, a replacement's untimed first step), and the run's
        steps before ``first_step``, are skipped, neither extending nor breaking a streak."""
        if not expected or any(r not in self.latest for r in expected):
            return []
        upto = min(self.latest[r] for r in expected)
        found: list[Finding] = []
        for step in sorted(s for s in self.steps if s <= upto):
            timings = self.steps.pop(step)
            if expected <= timings.keys() and step >= self.first_step:
                found += self._judge_step(step, {r: timings[r] for r in expected})
        self.judged_upto = max(self.judged_upto, upto)
        return found

    def _judge_step(self, step: int, timings: dict[int, Timing]) -> list[Finding]:
        slow: dict[str, set[int]] = {"rank": set(), "link": set()}
        for rank, t in timings.items():
            group = [p for r, p in timings.items() if self.role(r) == self.role(rank)]
            peers = [p for r, p in timings.items() if r != rank and self.role(r) == self.role(rank)]
            if not peers:
                continue
            slowest = max(p.compute for p in group)
            compute_med = statistics.median(p.compute for p in peers)
            link_med = statistics.median(p.link for p in peers)
            unexplained = t.wait - (slowest - t.compute)  # the wait no slower peer's compute accounts for
            checks = {"rank": (t.compute, compute_med, True),
                      "link": (t.link, link_med, unexplained >= self.min_excess_s)}
            for kind, (own, median, plausible) in checks.items():
                if plausible and own > self.factor * median and own - median >= self.min_excess_s:
                    slow[kind].add(rank)
                    ratio = own / median if median > 0 else float("inf")
                    self.streaks.setdefault((kind, rank), _Streak()).add(step, ratio, own, median, t.wait)
                else:
                    self.streaks.pop((kind, rank), None)
        found = []
        for kind, ranks in slow.items():
            for rank in sorted(ranks):
                streak = self.streaks[(kind, rank)]
                if len(streak) >= self.window and (kind, rank) not in self.reported:
                    found.append(self._finding(kind, rank, step, streak, timings))
        return self._merge_hosts(found, timings)

    def _finding(self, kind: str, rank: int, step: int, streak: _Streak, timings: dict[int, Timing]) -> Finding:
        self.reported.add((kind, rank))
        what = "compute" if kind == "rank" else "link"
        evidence = {f"{what}_s": round(statistics.median(streak.own), 6),
                    f"peers_{what}_s": round(statistics.median(streak.peers), 6),
                    "wait_s": round(statistics.median(streak.waits), 6),
                    "steps": len(streak), "threshold": self.factor, "min_excess_s": self.min_excess_s}
        return Finding(kind, rank, self.hosts[rank], [rank], round(statistics.median(streak.ratios), 3),
                       (streak.start, step), evidence)

    def _merge_hosts(self, found: list[Finding], timings: dict[int, Timing]) -> list[Finding]:
        """Rank findings covering every rank of a host (in a job of more than one host) become one host finding."""
        if len({self.hosts[r] for r in timings}) < 2:
            return found
        out = [f for f in found if f.kind != "rank"]
        by_host: dict[int, list[Finding]] = {}
        for f in found:
            if f.kind == "rank":
                by_host.setdefault(f.host, []).append(f)
        for host, findings in by_host.items():
            on_host = sorted(r for r in timings if self.hosts[r] == host)
            whole = all(self._slow_now("rank", r) for r in on_host)
            if not whole:
                out += findings
                continue
            self.reported.update(("rank", r) for r in on_host)
            first = findings[0]
            out.append(Finding("host", first.rank, host, on_host, first.factor, first.steps, first.evidence))
        return out

    def _slow_now(self, kind: str, rank: int) -> bool:
        streak: Optional[_Streak] = self.streaks.get((kind, rank))
        return streak is not None and len(streak) >= self.window


def config_problems(cfg) -> list[str]:
    """The ``straggler`` group's values, checked at config time."""
    s, out = cfg.straggler, []
    if not s.factor > 1:
        out.append(f"straggler.factor ({s.factor}) must be > 1: it is how many times slower than its peers' median a "
                   "rank must be to count as a straggler (default 1.2).")
    if s.window_steps < 1:
        out.append(f"straggler.window_steps ({s.window_steps}) must be >= 1: the consecutive slow steps that make a "
                   "straggler (default 20).")
    if s.min_excess_s < 0:
        out.append(f"straggler.min_excess_s ({s.min_excess_s}) must be >= 0 (default 0.005).")
    if s.quarantine_s < 0:
        out.append(f"straggler.quarantine_s ({s.quarantine_s}) must be >= 0: the seconds a host released by a "
                   "straggler swap (policy.straggler=[swap_spare]) waits before it rejoins as a spare (default 600).")
    return out


class StragglerWatch:
    """The controller's side: reads the timings from the heartbeats detection already fetched, judges them
    after each heartbeat round, emits ``straggler_detected`` with the action ``decide`` gives for the finding
    (the policy table's ``straggler`` row: ``runner.control.handover``; ``report``: the event and the console line,
    nothing else) and has ``act`` carry it out. A hand-over changes who computes the ranks: the findings left of
    that round, and every timing and streak so far, are about workers that no longer hold them, and are dropped."""

    def __init__(self, cfg, topo: Topology, events: EventLog, decide: Callable[[Finding], Decision],
                 act: Callable[[Finding, Decision], None]) -> None:
        s = cfg.straggler
        self.enabled = s.enabled
        self.judge = StragglerJudge(s.factor, s.window_steps, s.min_excess_s, role=lambda rank: topo.coords(rank)[1:],
                                    first_step=FIRST_JUDGED_STEP)
        self.events, self.decide, self.act = events, decide, act

    def read(self, w: Worker, hb: dict) -> None:
        records = hb.get("timing")
        if self.enabled and records:
            self.judge.add(w.logical, w.node, records)

    def poll(self, training: list[Worker], whole: bool) -> list[tuple[Finding, Decision]]:
        """Judge the steps every training rank timed, and act on each finding; ``training``: the live workers
        computing the job's logical ranks; ``whole``: every logical rank has its own worker and no recovery is
        open. Returns each finding with the decision taken on it."""
        if not self.enabled:
            return []
        if not whole:
            self.judge.pause()
            return []
        out = []
        for f in self.judge.judge({w.logical for w in training}):
            decision = self.decide(f)
            self.events.emit("straggler_detected", straggler=f.kind, rank=f.rank, host=f.host, ranks=f.ranks,
                             factor=f.factor, first_step=f.steps[0], at_step=f.steps[1], evidence=f.evidence,
                             action=decision.action, reason=decision.reason, fault_class="straggler")
            self.act(f, decision)
            out.append((f, decision))
            if decision.action != "report":
                self.judge.pause()
                break
        return out


def straggler_line(event: dict) -> str:
    """The console's line for a ``straggler_detected`` event."""
    what = {"rank": f"rank {event['rank']} is a straggler",
            "host": f"host {event['host']} (ranks {', '.join(map(str, event['ranks']))}) is a straggler",
            "link": f"slow link at rank {event['rank']} (host {event['host']})"}[event["straggler"]]
    measure = "link" if event["straggler"] == "link" else "compute"
    ev = event["evidence"]
    return (f"step {event['at_step']}: {what}: {measure} {ev[f'{measure}_s'] * 1e3:.1f} ms vs peers' median "
            f"{ev[f'peers_{measure}_s'] * 1e3:.1f} ms ({event['factor']:.2f}x for {ev['steps']} steps) "
            f"-> {event['action']} [policy.straggler]")
