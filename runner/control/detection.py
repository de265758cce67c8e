"""Detection: exits, workers' reports and heartbeats turned into symptoms of the open recovery.

Exits arrive at once from the node agents; a worker that caught a collective error reports it in
the store; heartbeats (workers' in the store, agents' from the fleet) reveal hangs, stalls and
silent nodes; a step that stays in a phase of a worker's own work past that phase's timeout
(``runner.control.phase_timeouts``) is a hang, and so is a worker that does not beat within its start-up timeout.
A generation whose every member sits in one step's reduction, or has not left a recovery's regroup, past that
phase's calibrated timeout is stuck as a whole: nobody computes, so the collective itself is (a dead link, a wedged
collective); the controller cuts the generation off (``protocol.cut_off_key``: every member gives its collective
up) and the members' reports lead to a retry. Before a decision, detection also answers whether everyone proved
alive since the first symptom, which nodes are silent, and who did not reach a retried generation's rendezvous.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Optional

from torch.distributed import PrefixStore

from runner.config.schema import HeartbeatConfig
from runner.control.beats import beat_source
from runner.control.incidents import Incidents, short
from runner.control.membership import Membership
from runner.control.phase_timeouts import GROUP, JUDGED, PhaseTimeouts
from runner.control.records import Recovery, Worker
from runner.plumbing import protocol
from runner.plumbing.events import EventLog
from runner.plumbing.protocol import Layout

TRAINING_PHASES = ("compute", "takeover", "reduce")
REGROUP_PHASES = ("starting", "rendezvous", "recovering")  # a member of a new generation not yet training in it


def slices_waits(cfg) -> bool:
    """Whether the workers' collective waits are sliced and so end when the controller cuts a generation off: gloo's
    are; an NCCL wait is not (its own timeout ends it), so the generation-wide rules cannot act under NCCL."""
    backend = cfg.parallel.backend
    if backend == "auto":
        import torch

        backend = "nccl" if cfg.runner.device == "cuda" or (cfg.runner.device == "auto" and
                                                             torch.cuda.is_available()) else "gloo"
    return backend != "nccl"


class Detector:
    """Watches the workers and nodes and raises symptoms; kills a worker it finds hung."""

    def __init__(self, cfg, members: Membership, incidents: Incidents, fleet, store, events: EventLog,
                 fail: Callable[[str], None]) -> None:
        self.cfg, self.hb = cfg, HeartbeatConfig.of(cfg.heartbeat)
        self.members, self.incidents = members, incidents
        self.fleet, self.store, self.events, self.fail = fleet, store, events, fail
        self.beats = beat_source(cfg, store, fleet)  # the workers' heartbeats, by heartbeat.route
        self.reports_seen = 0
        self.silent_reported: set[int] = set()  # nodes whose silence was already raised as a symptom
        self.nodes_lost: set[int] = set()  # nodes whose loss was decided: their silence is old news
        self._last_hb_poll = time.monotonic()
        self.beat_readers: list[Callable[[Worker, dict], None]] = []  # also read each heartbeat (straggler timings)
        # where everyone was, before a hang kill (or a stuck generation's cut-off: no one rank hung)
        self.diagnose: Optional[Callable[[Recovery, Optional[Worker]], None]] = None
        # how long a step's compute, checkpoint or reduction, a start-up or a regroup may last
        self.timeouts = PhaseTimeouts(cfg.heartbeat, cfg.launcher, events, group_rules=slices_waits(cfg))
        self.cut_off_gens: set[int] = set()  # generations the controller found stuck and cut off
        self.regrouped: set[int] = set()  # complete generations of recoveries whose regroup was timed (or judged)
        self.first_step: dict[int, int] = {}  # generation -> the first step a member was seen training in it
        self._look: Optional[dict[int, float]] = None  # the agents' beats as a decision in progress read them
        self.step_floors: dict[int, dict[str, float]] = {}  # node -> phase -> earliest step change (``_stall_due``)

    def node_beats(self) -> dict[int, float]:
        """When each agent last beat: read now, or as the decision in progress read them (``one_look``)."""
        return self._look if self._look is not None else self.fleet.node_beats()

    @contextmanager
    def one_look(self) -> Iterator[None]:
        """The agents' beats read once for a whole decision: one picture for every rule it asks, and one read
        instead of several (each a ``multi_get`` of every agent's key: ~6 ms at 2,048 hosts)."""
        self._look = self.fleet.node_beats()
        try:
            yield
        finally:
            self._look = None

    # -- symptoms ---------------------------------------------------------------------------------
    def is_news(self, wid: int, code: int) -> bool:
        """An exit not handled yet and not a normal end."""
        return not (self.members.workers[wid].dead or (code == 0 and self.store.check([f"done/{wid}"])))

    def on_exit(self, wid: int, code: int, t: float) -> None:
        self.incidents.symptom("exit", wid=wid, code=code, t=t)

    def poll_reports(self) -> None:
        n = self.store.add("reports", 0)
        while self.reports_seen < n:
            key = f"report/{self.reports_seen + 1}"
            try:
                self.store.wait([key], timedelta(seconds=1))
            except Exception:
                return  # written in a moment; read it next round
            self.reports_seen += 1
            rep = protocol.get_json(self.store, key)
            # about a generation already replaced, or from a worker already written off (a restart of every
            # rank kills the reporters before the next generation exists; a lost host's worker heard again after
            # a partition healed, even one that failed: it is fenced): nothing new
            stale = rep.get("gen", self.members.gen) < self.members.gen or self.members.workers[rep["wid"]].dead
            if rep.get("fatal") and not self.members.workers[rep["wid"]].dead:
                self.fail(f"worker {rep['wid']} failed: {rep['reason']}")
                return
            self.events.emit("symptom_reported", stale=stale, **short(rep))
            if not stale:
                self.incidents.symptom("report", **rep)

    def poll_heartbeats(self) -> None:
        now = time.monotonic()
        interval, misses = self.hb.interval_s, self.hb.misses
        # If this loop itself was late, what looks like silence may be ours: refresh, judge next round.
        judging = now - self._last_hb_poll < 2 * interval
        self._last_hb_poll = now
        node_beats = self.node_beats()
        for node, last_beat in node_beats.items():
            if judging and node not in self.silent_reported and now - last_beat > self.hb.silence_s:
                self.silent_reported.add(node)
                self.incidents.symptom("node_silent", node=node, t=time.time())
        self.beats.refresh()
        limits = {phase: self.timeouts.limit(phase) for phase in JUDGED}  # this round's, looked up per worker
        settled = {node: host for node, host in self.beats.settled().items()
                   if not self._stall_due(node, now, limits)}
        beating = []
        for w in self.members.live():
            if w.done or w.node in self.silent_reported:
                continue
            host = settled.get(w.node)
            if host is not None and host[0].get(w.wid) is w.hb_beat:
                # its agent heard it again and nothing else moved: it proved alive, and no rule can apply (its beat's
                # content was handled, it is not silent, its host has no step held past its phase's limit)
                w.hb_seq, w.hb_change = host[1], now
                continue
            if w.hb_seq >= 0 or self.beats.started(w):
                beating.append(w)
                continue
            timeout_s, calibrated = self.timeouts.startup_limit(w.role, w.t_spawn)
            if now - w.t_spawn > timeout_s and not w.killed_for:
                source = f"calibrated from this run's {w.role} start-ups" if calibrated else "launcher.start_timeout_s"
                self.kill_hung(w, f"no heartbeat within {timeout_s:.3g}s of its start ({source})", "hang",
                               {"phase": "startup", "timeout_s": round(timeout_s, 4), "calibrated": calibrated})
                if calibrated:
                    self.timeouts.acted("startup")
        silence_s, settles = self.hb.silence_s, self.beats.settles
        floors: dict[int, dict[str, float]] = {}  # node -> phase -> the earliest step change of its ranks read here
        for w, (seq, hb) in zip(beating, self.beats.read(beating)):
            if seq != w.hb_seq:
                if w.hb_seq < 0:  # its first beat, as this loop saw it
                    self.timeouts.observe_startup(w.role, now - w.t_spawn, at=now)
                w.hb_seq, w.hb_change = seq, now
            if hb is not w.hb_beat:  # content not handled yet (under route=agent most rounds bring none)
                w.hb_beat = hb
                self._handle(w, hb, now)
            if settles:  # only a source that settles hosts needs their floors (``_stall_due``)
                floor = floors.setdefault(w.node, {})
                if w.hb_phase in limits and w.hb_step_change < floor.get(w.hb_phase, math.inf):
                    floor[w.hb_phase] = w.hb_step_change
            if not judging:
                continue
            if now - w.hb_change > silence_s:
                node_beat = node_beats.get(w.node)
                if node_beat is not None and now - node_beat > 2 * self.hb.agent_beat_s:  # its node went silent too
                    self.silent_reported.add(w.node)
                    self.incidents.symptom("node_silent", node=w.node, t=time.time())
                else:
                    self.kill_hung(w, f"{misses} heartbeats missed ({interval}s interval; last phase {w.hb_phase})")
            elif (now - w.hb_change <= 2 * interval and (limit := limits.get(w.hb_phase)) is not None
                  and now - w.hb_step_change > limit[0] and (stall := self.stall(w, now, limit)) is not None):
                # it beats, but its step does not advance (a stopped process is the rule above's: its last phase
                # as seen may be stale)
                self.kill_hung(w, *stall)
        for node, floor in floors.items():
            if node in settled:  # some of its ranks were not walked: theirs still hold
                for phase, t in self.step_floors[node].items():
                    floor[phase] = min(t, floor.get(phase, t))
            self.step_floors[node] = floor
        if judging and self.incidents.active is None:
            self.judge_generation(now)
        self.timeouts.publish()

    def _stall_due(self, node: int, now: float, limits: dict[str, Optional[tuple[float, bool]]]) -> bool:
        """Whether a rank of ``node`` may have held its step past its phase's limit (``stall``), judged from the
        earliest step change per phase among its ranks as last walked: a step changes only in a beat's content, so
        between two records of the host these floors hold. A host never walked is due."""
        floor = self.step_floors.get(node)
        return floor is None or any((limit := limits[phase]) is not None and now - t > limit[0]
                                    for phase, t in floor.items())

    def _handle(self, w: Worker, hb: dict, now: float) -> None:
        """What a beat's content tells: its readers' share, a step or phase left (a dwell sampled), the generation
        joined, whether the worker trains."""
        for reader in self.beat_readers:
            reader(w, hb)
        if hb["step"] != w.hb_step or hb["phase"] != w.hb_phase:
            if w.hb_phase and self._sample(w):  # the dwell in the (step, phase) it left, as this loop saw it
                self.timeouts.observe(w.hb_phase, w.hb_step, now - w.hb_step_change)
            w.hb_step, w.hb_phase, w.hb_step_change = hb["step"], hb["phase"], now
        w.hb_gen = hb.get("gen", -1)
        if w.hb_gen >= 0 and w.hb_phase not in REGROUP_PHASES:
            self.first_step[w.hb_gen] = min(w.hb_step, self.first_step.get(w.hb_gen, w.hb_step))
        w.synced = w.synced or hb["phase"] in TRAINING_PHASES
        if w.first_step < 0 and hb["phase"] in TRAINING_PHASES:
            w.first_step = hb["step"]

    def _sample(self, w: Worker) -> bool:
        """Whether ``w``'s dwell in the (step, phase) it leaves is a sample of the phase: not in a generation found
        stuck (that dwell is the fault's), and not the reduction of a generation's first step, whose collectives
        connect the group's pairs (gloo connects them lazily, on first use: seconds on a loaded host), which the
        reduction rule does not judge either."""
        if w.hb_gen in self.cut_off_gens:
            return False
        return w.hb_phase not in GROUP or w.hb_step > self.first_step.get(w.hb_gen, w.hb_step)

    def stall(self, w: Worker, now: float, limit: Optional[tuple[float, bool]]) -> Optional[tuple[str, str, dict]]:
        """Whether ``w`` stayed in one step of a phase of its own work past that phase's timeout: the ``kill_hung``
        arguments saying so, with the timeout in effect (``limit``: ``PhaseTimeouts.limit`` of its phase), or None."""
        if limit is None or now - w.hb_step_change <= limit[0]:
            return None
        timeout_s, calibrated = round(limit[0], 4), limit[1]  # the one value the reason and the record both give
        source = "calibrated from this run" if calibrated else "heartbeat.stall_timeout_s"
        why = f"step {w.hb_step} not advancing in phase {w.hb_phase} for {timeout_s:.3g}s ({source})"
        return why, "hang", {"phase": w.hb_phase, "timeout_s": timeout_s, "calibrated": calibrated}

    def judge_generation(self, now: float) -> None:
        """The generation-wide rules, while no recovery is open: time a recovery's regroup (its complete generation's
        publication until every member trains in it), and cut the generation off if every member sits in one step's
        reduction, or in the regroup, past that phase's calibrated timeout (each member beating: a silent one is the
        heartbeat rule's)."""
        gen = self.members.gen
        layout = self.members.layouts.get(gen)
        if layout is None or gen in self.cut_off_gens:
            return
        workers = self.members.workers
        members = [workers[wid] for wid in layout.members]
        if any(w.dead or w.done for w in members):
            return  # a member is written off (a recovery follows) or finished (the run ends): nothing is stuck
        regroup = self._regroup(layout, now)
        if regroup is not None:
            action, waited_s = regroup
            timeout_s = self.timeouts.recovery_limit(action)
            trains = [w for w in members if w.hb_gen >= gen and w.hb_phase not in REGROUP_PHASES]
            if (timeout_s is not None and waited_s > timeout_s and not trains
                    and all(now - w.hb_change <= 2 * self.hb.interval_s for w in members)
                    and self._all_arrived(gen, len(members))):
                timeout_s = round(timeout_s, 4)
                self.cut_off(gen, f"no member of gen {gen} trains {waited_s:.3g}s after a {action} recovery published "
                                  f"it, calibrated timeout {timeout_s:.3g}s", {"phase": "recovery", "timeout_s":
                                                                             timeout_s, "calibrated": True})
            return
        reduction_s = self.timeouts.reduction_limit()
        if reduction_s is None or len({(w.hb_gen, w.hb_step, GROUP.get(w.hb_phase)) for w in members}) != 1:
            return
        w0 = members[0]
        stuck_s = now - max(w.hb_step_change for w in members)  # since the last member entered it
        if (w0.hb_gen == gen and GROUP.get(w0.hb_phase) == "reduction" and stuck_s > reduction_s
                and w0.hb_step > self.first_step.get(gen, w0.hb_step)  # the first step connects the group
                and all(now - w.hb_change <= 2 * self.hb.interval_s for w in members)):
            reduction_s = round(reduction_s, 4)
            self.cut_off(gen, f"every member of gen {gen} in the reduction of step {w0.hb_step} for {stuck_s:.3g}s "
                              f"(calibrated timeout {reduction_s:.3g}s): the collective is stuck",
                         {"phase": "reduction", "timeout_s": reduction_s, "calibrated": True})

    def _all_arrived(self, gen: int, size: int) -> bool:
        """Every member reached generation ``gen``'s rendezvous (``Comm._arrive``): the regroup's collectives are what
        waits. A member missing there is the rendezvous timeout's and, after a retry, ``isolate_unreachable``'s: cutting
        the generation off would only start another one it cannot reach either."""
        rendezvous = PrefixStore(f"pg/{gen}/", self.store)
        return rendezvous.check([f"arrived/{rank}" for rank in range(size)])

    def _regroup(self, layout: Layout, now: float) -> Optional[tuple[str, float]]:
        """(the action, seconds since publication) while the complete generation a recovery published has members
        that do not train in it yet; once all do, the regroup is timed for that action and None is returned."""
        if layout.gen in self.regrouped or not layout.complete or layout.recovery < 0:
            return None
        rec = next((r for r in self.incidents.record.recoveries if r.id == layout.recovery), None)
        if rec is None or not rec.action:
            return None
        workers = self.members.workers
        waited_s = now - self.members.published_at[layout.gen]
        if all(workers[wid].hb_gen >= layout.gen and workers[wid].hb_phase not in REGROUP_PHASES
               for wid in layout.members):
            self.regrouped.add(layout.gen)
            self.timeouts.observe_recovery(rec.action, waited_s)
            return None
        return rec.action, waited_s

    def cut_off(self, gen: int, why: str, rule: dict) -> None:
        """Generation ``gen`` is stuck as a whole: record the symptom and where everyone was, then tell every member to
        give its collective up (they report the failure, and the recovery retries; a member that cannot rejoin is
        found by the retry's rendezvous, ``isolate_unreachable``)."""
        self.cut_off_gens.add(gen)
        self.regrouped.add(gen)
        self.timeouts.acted(rule["phase"])
        self.incidents.symptom("stuck", gen=gen, why=why, t=time.time(), **rule)
        if self.diagnose is not None and self.incidents.active is not None:
            self.diagnose(self.incidents.active, None)
        self.events.emit("generation_cut_off", gen=gen, reason=why, **rule)
        self.store.set(protocol.cut_off_key(gen), why)

    def kill_hung(self, w: Worker, why: str, kind: str = "hang", rule: Optional[dict] = None) -> None:
        """``rule``: a stall's phase and the timeout in effect (recorded with the symptom)."""
        if w.killed_for:
            return
        w.killed_for = why
        self.incidents.symptom(kind, wid=w.wid, why=why, t=time.time(), **(rule or {}))
        if kind == "hang" and self.diagnose is not None and self.incidents.active is not None:
            self.diagnose(self.incidents.active, w)
        self.events.emit("worker_killed", wid=w.wid, logical=w.logical, reason=why)
        self.fleet.signal(w.wid, w.node, signal.SIGKILL)

    # -- what a decision asks ------------------------------------------------------------------------
    def dead_workers(self, rec: Recovery) -> list[int]:
        """Workers the recovery's symptoms name as gone (exited, hung, cut off), not yet written off."""
        dead = {s["wid"] for s in rec.symptoms if s["kind"] in ("exit", "hang", "unreachable") and "wid" in s}
        return sorted(w for w in dead if not self.members.workers[w].dead)

    def conclusive_exit(self, rec: Recovery) -> bool:
        """Whether the recovery can be decided before its window closes: its evidence is exits the node
        agents saw (and the survivors' reports of the collective they broke), and nothing else is uncertain.
        That is: no hang, silence or partition is in play (their evidence is an absence, which takes the
        window and the heartbeat rules); every victim of a fault the controller carried out has its exit in
        hand (a step's faults, a node loss beside a kill: they are decided together); every agent not lost
        beat within two of its beat periods (``agent_beat_s``: it missed none); and every other live, ready,
        unfinished worker reported a failure of the current generation or wrote a heartbeat within two
        intervals (read now, one round trip). A fault that strikes some other member at the same moment is
        therefore not yet visible; the window could not see it either, as its evidence would be that
        member's silence. Never with ``heartbeat.decide_at_once`` off: then every decision waits for the window."""
        if not self.hb.decide_at_once or any(s["kind"] not in ("exit", "report") for s in rec.symptoms):
            return False
        exited = {s["wid"] for s in rec.symptoms if s["kind"] == "exit"}
        if not exited - {w for w, worker in self.members.workers.items() if worker.dead}:
            return False  # nothing new has exited: the reports alone are a transient's evidence
        assigned, workers = self.members.assigned, self.members.workers
        for rank in self.incidents.injected_victims:
            wid = assigned.get(rank)
            if wid is not None and wid not in exited and not workers[wid].dead:
                return False  # an injected fault's exit is still on its way (or never comes: a lost node)
        now, interval, agents_within = time.monotonic(), self.hb.interval_s, 2 * self.hb.agent_beat_s
        if any(now - beat > agents_within for node, beat in self.node_beats().items()
               if node not in self.nodes_lost):
            return False
        # a report about the current generation: alive since it failed (an older one proves nothing now)
        reported = {s["wid"] for s in rec.symptoms if s["kind"] == "report" and s.get("gen", -1) >= self.members.gen}
        others = [w for w in self.members.live()
                  if w.ready and not w.done and w.wid not in exited and w.wid not in reported]
        if not others:
            return True
        return self.beats.all_heard(others, 2 * interval, time.time())

    def silent_nodes_now(self) -> set[int]:
        limit = self.hb.silence_s
        return {node for node, beat in self.node_beats().items() if time.monotonic() - beat > limit}

    def silent_nodes(self, rec: Recovery, now: float) -> list[int]:
        """Nodes silent now or named silent by the recovery, whose loss is not decided yet."""
        limit = self.hb.silence_s
        silent = {node for node, beat in self.node_beats().items() if now - beat > limit}
        silent |= {s["node"] for s in rec.symptoms if s["kind"] == "node_silent"}
        return sorted(silent - self.nodes_lost)

    def all_proved_alive(self, since: float) -> bool:
        """Every live worker and agent has beaten since the first symptom (a silent one is caught by the
        heartbeat rules within the miss window, and the decision then sees it as dead)."""
        agents_ok = all(beat > since for node, beat in self.node_beats().items() if node not in self.nodes_lost)
        return agents_ok and all(w.hb_change > since for w in self.members.live() if w.ready and not w.done)

    def isolate_unreachable(self, rec: Recovery, now: float) -> bool:
        """A retry whose own generation failed again: members that do not arrive at its rendezvous
        while the others do are alive but cut off from their peers (a partition); they are killed and
        handled as failed ranks. Returns True while the arrivals are still being waited for."""
        last = self.incidents.last_acted(rec)
        if last is None or last.action != "retry" or last.full_gen is None:
            return False
        if not any(s.get("gen") == last.full_gen for s in rec.symptoms if s["kind"] == "report"):
            return False
        gen = last.full_gen
        rendezvous = PrefixStore(f"pg/{gen}/", self.store)  # where Comm._arrive writes
        workers = self.members.workers
        missing = [wid for rank, wid in enumerate(self.members.layouts[gen].members)
                   if not rendezvous.check([f"arrived/{rank}"]) and not workers[wid].dead]
        grace = self.hb.silence_s  # healthy members arrive in milliseconds
        if missing and now - self.members.published_at[gen] < grace:
            return True
        for wid in missing:
            self.kill_hung(workers[wid], f"did not reach gen {gen}'s rendezvous after a retry while its peers "
                                         "did: alive but cut off from them", kind="unreachable")
        return False
