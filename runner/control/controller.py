"""The controller: one loop that runs the job's control plane, wiring the parts that do the work.

It hosts the job's TCPStore (unless the job has one), starts the workers through the fleet, and then,
every round, lets detection turn exits, reports and heartbeats into symptoms
(``runner.control.detection``), lets the fault injectors act (``runner.faults``), lets the recovery
actions pace their own work, and, once a recovery is due, has the executor decide and act
(``runner.control.execution``). Under ``launcher.mode=per_host`` it also admits hosts that join the running
job later (``runner.agents.joins``) and hands each to the recovery actions. It is never on the training
path: healthy steps cost it nothing. At the end it writes the summary from the run's record.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from queue import Empty, Queue
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from runner.agents.fleet import AgentFleet
from runner.agents.joins import HostJoins
from runner.config import policy
from runner.config.schema import HeartbeatConfig
from runner.config.validate import ft_names
from runner.control.console import RecoveryConsole
from runner.control.context import RunContext
from runner.control.detection import Detector
from runner.control.diagnosis import Diagnoser
from runner.control.execution import Executor
from runner.control.handover import Handover
from runner.control.incidents import Incidents
from runner.control.membership import Membership
from runner.control.records import RunRecord, last_step
from runner.control.run_logger import RunLogger
from runner.control.stop import StopOnSignal
from runner.control.stragglers import StragglerWatch
from runner.faults.chaos_injector import ChaosInjector
from runner.faults.injector import FaultInjector
from runner.planning.topology import Topology
from runner.plumbing import protocol
from runner.plumbing.events import EventLog
from runner.recovery.actions import NodePersist
from runner.recovery.registry import build_actions
from runner.report.summary import write_summary

FORKSERVER_PRELOAD = ["runner.training.worker"]
READY_POLL_S = 0.002  # how often an open recovery looks for its replacements' ready keys


def agent_setup(actions: dict) -> tuple[list[str], Optional[NodePersist]]:
    """What every node agent runs beside its workers: its fork server's preloads and its node's persister."""
    preload = FORKSERVER_PRELOAD + [m for a in actions.values() for m in a.worker_preload()]
    persist = next((p for a in actions.values() if (p := a.node_persister()) is not None), None)
    return preload, persist


def loop_wait_s(idle_s: float, until_decision_s: Optional[float], awaiting_ready: bool) -> float:
    """How long the controller's loop may wait for an exit before its next round: ``idle_s``, but no longer than
    until a decision is due, and only ``READY_POLL_S`` while an open recovery waits for a replacement (its
    readiness is a store key read each round, not a queued event: read every 50 ms, a replacement ready in 55 ms
    was seen at 100 ms)."""
    wait = idle_s if until_decision_s is None else min(idle_s, max(0.0, until_decision_s))
    return min(wait, READY_POLL_S) if awaiting_ready else wait


class Controller:
    """``fleet`` starts and signals workers (AgentFleet, or ExternalFleet under per_rank);
    ``store`` is given when the job already has one (torchrun's agent store, or the one node 0 hosts
    under per_host), else hosted here."""

    def __init__(self, cfg: DictConfig, run_dir: Path, fleet=None, store=None,
                 address: Optional[tuple[str, int]] = None, namespace: str = "",
                 agents_started_here: Optional[list[int]] = None) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.fleet, self.store, self.namespace = fleet, store, namespace
        self.host, self.port = address or ("127.0.0.1", 0)  # the store's address, as workers and agents reach it
        self.agents_started_here = agents_started_here  # per_host: node 0's agent only; None: every node's
        self.topo = Topology.from_cfg(cfg)
        self.ft = ft_names(cfg)
        self.queue: Queue = Queue()
        self.actions = build_actions(self.ft, cfg, self.topo, self.run_dir)
        self.record = RunRecord(ft=list(self.ft), dp=self.topo.dp, t_start=time.time())
        self.events = EventLog(self.run_dir / "events.jsonl", rank=lambda: "controller", step=lambda: -1,
                               echo=RecoveryConsole(cfg.trainer.progress_bar) if cfg.runner.console_events else None)
        self.run_logger = RunLogger(cfg, self.run_dir, self.record)
        self.joins: Optional[HostJoins] = None  # per_host: hosts that join the running job

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            self.start()
        except RuntimeError as err:  # a host refused at start-up (its secret, its config, its layout)
            return self._refused(str(err))
        self.run_logger.start()
        summary: Optional[dict] = None
        stop = StopOnSignal(self.store, self.events, self.fleet.post_notice)
        try:
            try:
                with stop:
                    self.launch()
                    self._loop()
            except KeyboardInterrupt:
                self._fail("interrupted by the user (Ctrl-C)")
            finally:
                self.end(stop)
            if stop.requested is not None:
                print(stop.last_line(self.run_dir), flush=True)
            summary = write_summary(self.cfg, self.run_dir, self.record)
            return summary
        finally:  # the experiment logger is finished in every ending, with the summary when there is one
            self.run_logger.finish(summary)

    def end(self, stop: StopOnSignal) -> None:
        """The run's one verdict, then everyone is told: every host's agent (its exit code), the actions, run_end.
        summary.json is written from the same record."""
        self.record.done = self.members.done_records()
        last = last_step(self.record.done, self.cfg.trainer.max_steps)
        if self.record.status == "completed" and stop.stopped_early(self.record.done, last):
            self.record.status = "stopped"  # at the step SIGINT/SIGTERM asked for, with a checkpoint
        self.record.judge_end()
        self.record.phase_timeouts = self.detector.timeouts.state()
        self.fleet.shutdown(self.record.status)
        for action in self.actions.values():
            action.on_end(self.ctx)
        self.events.emit("run_end", status=self.record.status, error=self.record.error)

    def _refused(self, reason: str) -> dict:
        """The job could not start (a host's agent refused, or never registered): it fails at once, naming the host
        and the reason, in events.jsonl and summary.json; the hosts that did start see the store close and exit."""
        self.record.status, self.record.error = "failed", reason
        self.events.emit("run_failed", error=reason)
        self.events.emit("run_end", status=self.record.status, error=self.record.error)
        return write_summary(self.cfg, self.run_dir, self.record)

    def start(self) -> None:
        """Host the store and start the fleet unless the job brought them; build the parts."""
        if self.store is None:
            self.store = protocol.host_store(self.host, self.cfg.launcher.start_timeout_s)
            self.port = self.store.port
        if self.fleet is None:
            preload, persist = agent_setup(self.actions)
            self.fleet = AgentFleet(self.cfg, self.run_dir, self.store, (self.host, self.port), self.queue, preload,
                                    persist, self.topo.total_nodes, self.agents_started_here)
            if self.agents_started_here is not None:
                self.joins = HostJoins(self.store, self.fleet, self.events, (self.host, self.port),
                                       self.cfg.launcher.start_timeout_s)
        self._wire()
        self.events.emit("run_start", world_size=self.topo.world, nodes=self.cfg.parallel.nodes, ft=self.ft,
                         recipe=self.cfg.recipe_name, store_port=self.port, policy=policy.table(self.cfg, self.ft))

    def launch(self) -> None:
        """Spawn every logical rank on its node (and whatever the actions start), publish generation 0."""
        for lrank in range(self.topo.world):
            self.members.spawn(lrank, *self.topo.place(lrank), role="initial", first_gen=0)
        for w in self.members.workers.values():
            w.ready = w.synced = True
        for action in self.actions.values():
            action.on_start(self.ctx)
        self.members.publish()
        # What exists now (the workers' records, the config, the parts) lives as long as the run: the cyclic
        # collector's full passes skip it from here on. At 8,192 ranks a full pass over it took 0.17 s every ~10 s,
        # a pause of the loop that decides recoveries (bench/control_scale.py).
        gc.freeze()

    def _wire(self) -> None:
        """Build the parts once the store and the fleet exist, each given its collaborators."""
        cfg = self.cfg
        plain_cfg = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(plain_cfg, dict)  # a DictConfig converts to a dict
        self.members = Membership(plain_cfg, self.run_dir, self.topo.world, self.store,
                                  self.fleet, self.events, (self.host, self.port), self.namespace)
        self.incidents = Incidents(self.record, self.events, cfg.heartbeat.decide_window_s)
        self.detector = Detector(cfg, self.members, self.incidents, self.fleet, self.store, self.events, self._fail)
        self.detector.diagnose = Diagnoser(self.run_dir, self.members, self.fleet, self.detector.beats,
                                           cfg.heartbeat.interval_s, self.events).collect
        self.ctx = RunContext(cfg, self.ft, self.topo, self.members, self.detector, self.incidents, self.events,
                              self.store, self.fleet, tuple(self.actions.values()))
        self.executor = Executor(self.ctx, self.actions, self._fail)
        self.handover = Handover(self.ctx, self.actions, self.executor.after_change)
        self.stragglers = StragglerWatch(cfg, self.topo, self.events, self.handover.decide, self.handover.act)
        self.detector.beat_readers.append(self.stragglers.read)
        memory = next((m for a in self.actions.values() if (m := a.host_memory()) is not None), None)
        self.injector = FaultInjector(cfg, self.ctx, memory)
        self.chaos: Optional[ChaosInjector] = (ChaosInjector(cfg, self.ctx, self.injector, self.executor.judge)
                                               if cfg.fault.kind == "chaos" else None)

    def _loop(self) -> None:
        deadline = time.monotonic() + self.cfg.launcher.run_timeout_s
        heartbeat = HeartbeatConfig.of(self.cfg.heartbeat)
        interval_s, idle_s = heartbeat.interval_s, heartbeat.controller_wait_s
        next_hb = time.monotonic()
        while self.record.status == "running":
            try:
                self.on_event(self.queue.get(timeout=self._wait_s(time.monotonic(), idle_s)))
                while True:  # every exit queued by now, so that a decision due this round sees them all
                    self.on_event(self.queue.get_nowait())
            except Empty:
                pass
            now = time.monotonic()
            heartbeats = now >= next_hb
            if heartbeats:
                next_hb = now + interval_s
            self.round(now, heartbeats)
            if self.record.status == "running" and now > deadline:
                self._fail(f"the run exceeded launcher.run_timeout_s={self.cfg.launcher.run_timeout_s:.0f}s")

    def _wait_s(self, now: float, idle_s: float) -> float:
        decide_at = self.incidents.decide_at
        return loop_wait_s(idle_s, None if decide_at is None else decide_at - now,
                           self.incidents.active is not None and self.members.starting())

    def round(self, now: float, heartbeats: bool) -> None:
        """One pass over everything but the exits: reports, faults, heartbeats (when due), replacements
        that became ready, the actions' own pacing, a due decision, and the end of the run. A worker's fatal report
        ends the run here: nothing after it may decide a recovery (the worker's exit opened one) or publish a
        generation. An exit makes the decision due at once, before its window closes: that early look comes before
        the heartbeat poll, which walks every worker (tens of milliseconds at 16,384 ranks,
        bench/control_scale.py), as it decides only on evidence it reads itself (``Detector.conclusive_exit``);
        every other decision waits for the poll, whose heartbeats may be its proof of life."""
        self.detector.poll_reports()
        if self.record.status != "running":
            return
        self.injector.poll()
        if self.chaos is not None:
            self.chaos.poll(now)
        decide_at = self.incidents.decide_at
        if decide_at is not None and decide_at <= now < self.incidents.window_ends:  # an exit's early look
            self.executor.decide_due(now)
            if self.record.status != "running":
                return  # the decision was to fail the run
        if heartbeats:
            self.detector.poll_heartbeats()
            training = [w for w in self.members.live() if w.synced and not w.done]
            whole = self.incidents.active is None and len({w.logical for w in training}) == self.topo.world
            self.stragglers.poll(training, whole)
            if self.joins is not None:
                for node in self.joins.poll():  # a spare host: no generation changes, training goes on
                    for action in self.actions.values():
                        action.on_host_joined(self.ctx, node)
        if self.members.poll_ready() and self.incidents.active is not None and self.incidents.decide_at is None:
            self.executor.after_change()
        for action in self.actions.values():
            action.poll(self.ctx, now)
        self.handover.poll(now)
        if self.incidents.decide_at is not None and now >= self.incidents.decide_at:
            self.executor.decide_due(now)
        if self.incidents.active is None and self.members.all_done():
            self.record.status = "completed"
            self.store.set("abort", "the run completed")  # releases spares still waiting for a rank

    def on_event(self, item) -> None:
        """An exit from a node agent: news unless already handled or a normal end; an action's own
        process (a spare) is the action's business, any other one a symptom."""
        kind, wid, code, t = item
        if kind != "exit" or not self.detector.is_news(wid, code):
            return
        if any(action.on_exit(self.ctx, wid, code) for action in self.actions.values()):
            return
        self.detector.on_exit(wid, code, t)

    # -- the end ------------------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        if self.record.status != "running":
            return
        self.record.status, self.record.error = "failed", reason
        self.store.set("abort", reason)
        self.events.emit("run_failed", error=reason)
