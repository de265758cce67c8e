"""The controller: membership, generations, detection, decisions and the end of the run.

It hosts the job's TCPStore, starts workers through the node agents, watches exits (at once),
heartbeats (hangs and silent deaths) and workers' reports (collective errors), classifies each
fault, carries out the action the fault-tolerance mix allows, and publishes generations. It is
never on the training path: healthy steps cost it nothing.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from queue import Empty, Queue
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from torch.distributed import PrefixStore, TCPStore

from runner import chaos, protocol
from runner.agent import LocalFleet
from runner.config import policy
from runner.config.validate import all_faults, ft_names
from runner.decision import Decision, decide, restart_owner
from runner.events import EventLog
from runner.loggers import log_summary_to_wandb
from runner.protocol import Layout
from runner.recovery import memory_faults
from runner.recovery.flash_ckpt import cleanup as cleanup_snapshots
from runner.recovery.flash_ckpt.persister import NodePersist
from runner.recovery.flash_names import flash_job_id
from runner.recovery.sdc import MIN_HISTORY
from runner.summary import write_summary
from runner.topology import Topology

FORKSERVER_PRELOAD = ["runner.worker"]
CHAOS_END_MARGIN_STEPS = 5  # no chaos fault this close to trainer.max_steps: it would hit ranks that are finishing


@dataclass
class Recovery:
    """What the controller knows of one recovery; worker events fill in the rest at the end."""

    id: int
    t_detect: float
    t_detect_mono: float
    symptoms: list = field(default_factory=list)
    fault: str = ""
    victims: list = field(default_factory=list)
    step: int = -1
    action: str = ""
    reason: str = ""
    t_fault: Optional[float] = None
    t_decide: Optional[float] = None
    t_ready: Optional[float] = None
    survivors_gen: Optional[int] = None
    full_gen: Optional[int] = None


@dataclass
class Worker:
    wid: int
    node: int
    local_rank: int
    logical: int
    role: str
    t_spawn: float
    ready: bool = False
    synced: bool = False  # holds the model/optimizer state (an initial worker, or a joiner seen training)
    done: bool = False
    dead: bool = False
    killed_for: str = ""  # set when the controller itself killed it (hang)
    hb_seq: int = -1
    hb_change: float = 0.0
    hb_step: int = -1
    hb_step_change: float = 0.0
    hb_phase: str = ""
    first_step: int = -1  # the step of its first heartbeat while training (its guard's history starts there)


class Controller:
    """``fleet`` starts and signals workers (LocalFleet, or ExternalFleet under torchrun/SLURM);
    ``store`` is given when the job already has one (torchrun's agent store), else hosted here."""

    def __init__(self, cfg: DictConfig, run_dir: Path, fleet=None, store=None, address=None, namespace: str = "") -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.fleet, self.store, self.namespace = fleet, store, namespace
        self.host, self.port = address or ("127.0.0.1", 0)
        self.topo = Topology.from_cfg(cfg)
        self.dp = self.topo.dp
        self.ft = ft_names(cfg)
        self.hb = cfg.heartbeat
        self.queue: Queue = Queue()
        self.workers: dict[int, Worker] = {}
        self.assigned: dict[int, int] = {}  # logical rank -> wid
        self.takeovers: dict[int, int] = {}  # NDB: a failed logical rank -> the wid computing it too
        self.repairs: list[tuple[float, int]] = []  # NDB: (when, logical rank) to restart and rejoin
        self.takeover_from: dict[int, int] = {}  # NDB: logical rank -> the committed step its takeover began at
        self.rejoining: dict[int, int] = {}  # NDB: logical rank -> wid of its restarted process
        self.spares: list[int] = []  # DeadPool: started, warm, not yet given a logical rank
        self.gen = -1
        self.recoveries: list[Recovery] = []
        self._recovery_ids = 0
        self._done_seen = 0
        self.layouts: dict[int, Layout] = {}
        self.published_at: dict[int, float] = {}
        self.active: Optional[Recovery] = None
        self.decide_at: Optional[float] = None
        self.restarts = 0
        self.full_restarts = 0  # restart_all actions (ft=flash_ckpt)
        self.reports_seen = 0
        self.status, self.error = "running", ""
        self.flash_job = flash_job_id(self.run_dir) if "flash_ckpt" in self.ft else None
        self.faults = [f for f in all_faults(cfg) if f.kind != "none"]  # indexed as the workers index them
        self.chaos = chaos.Chaos(cfg.fault, cfg.seed) if cfg.fault.kind == "chaos" else None
        self.chaos_wait: Optional[tuple[float, int, int]] = None  # the last chaos fault: (when, recovery id, step)
        self.fault_hits: dict[int, dict] = {}
        self.injected_victims: set[int] = set()  # killed by an injected fault, for the next recovery's record
        self.silent_reported: set[int] = set()  # nodes whose silence was already raised as a symptom
        self.nodes_lost: set[int] = set()  # nodes whose loss was decided: their silence is old news
        self._last_hb_poll = time.monotonic()
        self.t_start = time.time()
        self.events = EventLog(self.run_dir / "events.jsonl", rank=lambda: "controller", step=lambda: -1,
                               echo=self._echo if cfg.runner.console_events else None)

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self) -> dict:
        if self.store is None:
            self.store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=self.cfg.launcher.start_timeout_s))
            self.port = self.store.port
        if self.fleet is None:
            fc = self.cfg.ft.flash_ckpt if self.flash_job is not None else None
            persist = NodePersist(self.flash_job, self.run_dir / "checkpoints", fc.keep, self.run_dir / "events.jsonl") \
                if fc is not None and fc.persist_every_n_steps else None  # a persister per node (runner/agent.py)
            preload = FORKSERVER_PRELOAD + (["runner.recovery.flash_ckpt.warm_kernels"] if self.flash_job is not None else [])
            self.fleet = LocalFleet(self.topo.total_nodes, self.queue, self.hb.interval_s, preload, persist)
        self.cfg_dict = OmegaConf.to_container(self.cfg, resolve=True)
        self.events.emit("run_start", world_size=self.dp, nodes=self.cfg.parallel.nodes, ft=self.ft,
                         recipe=self.cfg.recipe_name, store_port=self.port, policy=policy.table(self.cfg, self.ft))
        try:
            for lrank in range(self.dp):
                self._spawn(lrank, *self.topo.place(lrank), role="initial", first_gen=0)
            for w in self.workers.values():
                w.ready = w.synced = True
            for i in range(self.topo.spares):  # hot spares live on nodes of their own
                self.spares.append(self._spawn(-1, *self.topo.spare_place(i), role="spare", first_gen=0).wid)
            self._publish()
            self._loop()
        except KeyboardInterrupt:
            self._fail("interrupted by the user (Ctrl-C)")
        finally:
            self.fleet.shutdown(completed=self.status == "completed")
            if self.flash_job is not None:  # every worker is gone: no restart can need the snapshots now
                self.events.emit("snapshots_removed", segments=len(cleanup_snapshots(self.flash_job)))
            self.events.emit("run_end", status=self.status, error=self.error)
        summary = write_summary(self)
        log_summary_to_wandb(self.cfg, self.run_dir, summary)
        return summary

    def _loop(self) -> None:
        deadline = time.monotonic() + self.cfg.launcher.run_timeout_s
        poll = min(self.hb.interval_s, 0.05)
        next_hb = time.monotonic()
        while self.status == "running":
            try:
                self._on_event(self.queue.get(timeout=poll))
                while True:  # every exit queued by now, so that a decision due this round sees them all
                    self._on_event(self.queue.get_nowait())
            except Empty:
                pass
            now = time.monotonic()
            self._poll_reports()
            self._poll_faults()
            self._poll_chaos(now)
            if now >= next_hb:
                self._poll_heartbeats()
                next_hb = now + self.hb.interval_s
            self._poll_ready()
            self._poll_repairs(now)
            if self.decide_at is not None and now >= self.decide_at:
                self._decide()
            if self._all_done():
                self.status = "completed"
                self.store.set("abort", "the run completed")  # releases spares still waiting for a rank
            elif now > deadline:
                self._fail(f"the run exceeded launcher.run_timeout_s={self.cfg.launcher.run_timeout_s:.0f}s")

    # -- processes ------------------------------------------------------------------------------
    def _spawn(self, lrank: int, node: int, local: int, role: str, first_gen: int) -> Worker:
        from runner.worker import WorkerSpec, main  # imported lazily: the launching process stays light

        wid = len(self.workers)
        spec = WorkerSpec(str(self.run_dir), wid, node, local, lrank, role, first_gen, self.host, self.port,
                          self.namespace)
        self.fleet.spawn(main, (spec, self.cfg_dict), wid, node)
        worker = Worker(wid, node, local, lrank, role, t_spawn=time.monotonic())
        self.workers[wid] = worker
        if lrank >= 0:
            self.assigned[lrank] = wid
        return worker

    def _live(self) -> list[Worker]:
        return [w for w in self.workers.values() if not w.dead and self.assigned.get(w.logical) == w.wid]

    # -- generations ----------------------------------------------------------------------------
    def _publish(self, recovery: Optional[Recovery] = None) -> Layout:
        """Publish the next generation: every ready assigned worker; the rest of the logical ranks pending."""
        self.gen += 1
        members = sorted((w for w in self._live() if w.ready), key=lambda w: w.logical)
        extra = [sorted(l for l, wid in self.takeovers.items() if wid == w.wid) for w in members]
        covered = {w.logical for w in members} | set(self.takeovers)
        layout = Layout(
            gen=self.gen, members=[w.wid for w in members], logical=[w.logical for w in members], dp=self.dp,
            pending=sorted(set(range(self.dp)) - covered),
            joiners=[w.wid for w in members if w.role == "joiner"],
            recovery=recovery.id if recovery else -1,
            extra=extra if any(extra) else [],
        )
        self.layouts[self.gen] = layout
        self.published_at[self.gen] = time.monotonic()
        self.store.set(f"gen/{self.gen}", layout.to_json())
        self.store.set("gen", str(self.gen))
        self.events.emit("generation", gen=self.gen, members=layout.members, pending=layout.pending,
                         recovery=layout.recovery, extra=layout.extra)
        return layout

    # -- detection --------------------------------------------------------------------------------
    def _on_event(self, item) -> None:
        kind = item[0]
        if kind == "exit":
            _, wid, code, t = item
            w = self.workers[wid]
            if w.dead or (code == 0 and self.store.check([f"done/{wid}"])):
                return  # already handled, or a normal end
            if wid in self.spares:
                self.spares.remove(wid)
                w.dead = True
                self.events.emit("spare_lost", wid=wid, code=code, spares_left=len(self.spares))
                return
            self._symptom("exit", wid=wid, code=code, t=t)

    def _poll_reports(self) -> None:
        n = self.store.add("reports", 0)
        while self.reports_seen < n:
            key = f"report/{self.reports_seen + 1}"
            try:
                self.store.wait([key], timedelta(seconds=1))
            except Exception:
                return  # written in a moment; read it next round
            self.reports_seen += 1
            rep = protocol.get_json(self.store, key)
            if rep.get("fatal"):
                self._fail(f"worker {rep['wid']} failed: {rep['reason']}")
                return
            # about a generation already replaced, or from a worker already written off (a restart of every
            # rank kills the reporters before the next generation exists): nothing new
            stale = rep.get("gen", self.gen) < self.gen or self.workers[rep["wid"]].dead
            self.events.emit("symptom_reported", stale=stale, **_short(rep))
            if not stale:
                self._symptom("report", **rep)

    def _poll_heartbeats(self) -> None:
        now = time.monotonic()
        interval, misses = self.hb.interval_s, self.hb.misses
        # If this loop itself was late, what looks like silence may be ours: refresh, judge next round.
        judging = now - self._last_hb_poll < 2 * interval
        self._last_hb_poll = now
        for node, last_beat in self.fleet.node_beats().items():
            if judging and node not in self.silent_reported and now - last_beat > interval * misses:
                self.silent_reported.add(node)
                self._symptom("node_silent", node=node, t=time.time())
        beating = []
        for w in self._live():
            if w.done or w.node in self.silent_reported:
                continue
            if w.hb_seq >= 0 or self.store.check([f"hb/{w.wid}"]):
                beating.append(w)
            elif now - w.t_spawn > self.cfg.launcher.start_timeout_s:
                self._kill_hung(w, f"no heartbeat within launcher.start_timeout_s={self.cfg.launcher.start_timeout_s}")
        payloads = self.store.multi_get([f"hb/{w.wid}" for w in beating]) if beating else []
        for w, raw in zip(beating, payloads):  # one round trip for every beating worker
            hb = json.loads(raw)
            if hb["seq"] != w.hb_seq:
                w.hb_seq, w.hb_change = hb["seq"], now
            if hb["step"] != w.hb_step or hb["phase"] != w.hb_phase:
                w.hb_step, w.hb_phase, w.hb_step_change = hb["step"], hb["phase"], now
            w.synced = w.synced or hb["phase"] in ("compute", "takeover", "reduce")
            if w.first_step < 0 and hb["phase"] in ("compute", "takeover", "reduce"):
                w.first_step = hb["step"]
            if not judging:
                continue
            if now - w.hb_change > interval * misses:
                node_beat = self.fleet.node_beats().get(w.node)
                if node_beat is not None and now - node_beat > 2 * interval:  # its node went silent with it
                    self.silent_reported.add(w.node)
                    self._symptom("node_silent", node=w.node, t=time.time())
                else:
                    self._kill_hung(w, f"{misses} heartbeats missed ({interval}s interval; last phase {w.hb_phase})")
            elif w.hb_phase == "compute" and now - w.hb_step_change > self.hb.stall_timeout_s:
                self._kill_hung(w, f"step {w.hb_step} not advancing for {self.hb.stall_timeout_s}s")

    def _kill_hung(self, w: Worker, why: str, kind: str = "hang") -> None:
        if w.killed_for:
            return
        w.killed_for = why
        self._symptom(kind, wid=w.wid, why=why, t=time.time())
        self.events.emit("worker_killed", wid=w.wid, logical=w.logical, reason=why)
        self.fleet.signal(w.wid, w.node, signal.SIGKILL)

    def _ready_spares(self) -> list[int]:
        return [wid for wid in self.spares if self.workers[wid].node not in self._silent_nodes_now()
                and self.store.check([f"ready/{wid}"])]

    def _silent_nodes_now(self) -> set[int]:
        limit = self.hb.interval_s * self.hb.misses
        return {node for node, beat in self.fleet.node_beats().items() if time.monotonic() - beat > limit}

    def _poll_ready(self) -> None:
        changed = False
        for w in self._live():
            if not w.ready and self.store.check([f"ready/{w.wid}"]):
                w.ready = True
                changed = True
                self.events.emit("replacement_ready", wid=w.wid, logical=w.logical,
                                 startup_s=time.monotonic() - w.t_spawn)
        if changed and self.active is not None and self.decide_at is None:
            self._after_change()
        done_count = self.store.add("done_count", 0)
        if done_count != self._done_seen:  # only then look at the individual keys
            self._done_seen = done_count
            for w in self._live():
                if not w.done and self.store.check([f"done/{w.wid}"]):
                    w.done = True

    def _symptom(self, kind: str, **details) -> None:
        if self.status != "running":
            return
        now = time.time()
        if self.active is None:
            self.active = Recovery(id=self._recovery_ids, t_detect=now, t_detect_mono=time.monotonic())
            self._recovery_ids += 1
            self.recoveries.append(self.active)
            self.events.emit("fault_detected", recovery=self.active.id, symptom=kind, **_short(details))
        self.active.symptoms.append({"kind": kind, **details})
        if self.decide_at is None:
            self.decide_at = time.monotonic() + self.hb.decide_window_s

    def _poll_faults(self) -> None:
        for i, fault in enumerate(self.faults):
            if i in self.fault_hits or fault.kind in ("transient", "slow_rank", "bitflip", "slow_link", "partition",
                                                      "chaos"):
                continue
            key = f"fault/hit/{i}"
            if not self.store.check([key]):
                continue
            hit = protocol.get_json(self.store, key)
            self.fault_hits[i] = hit
            self._inject(i, fault, hit)

    def _inject(self, i: int, fault, hit: dict) -> None:
        """Carry out a fault the victim announced: the kill comes from this process, not the victim."""
        self._carry_out(i, fault.kind, self.workers[hit["wid"]], fault.node, hit["step"])
        self.store.set(f"fault/released/{i}", "1")

    def _carry_out(self, index: int, kind: str, w: Worker, node: int, at_step: Optional[int] = None) -> None:
        """SIGKILL or SIGSTOP worker ``w``, lose ``node``, or kill every rank (and damage snapshot memory).
        ``at_step``: the step boundary the victim announced; a chaos fault lands mid-step, at no known step."""
        t = time.time()
        memory = {}
        if kind == "kill_rank":
            self.fleet.signal(w.wid, w.node, signal.SIGKILL)
            victims = [w.logical]
        elif kind == "hang_rank":
            self.fleet.signal(w.wid, w.node, signal.SIGSTOP)
            victims = [w.logical]
        elif kind == "kill_node":
            wids = self.fleet.lose_node(node)
            victims = [r for r in (self.workers[v].logical for v in wids) if r >= 0]
            self._await_exit([self.workers[v] for v in wids])
            if self.flash_job is not None:  # the node's memory went with it (all nodes share this host's /dev/shm)
                memory["segments_lost"] = len(memory_faults.drop_node_memory(self.flash_job, victims))
        else:  # kill_all, wipe_shm, corrupt_snapshot: every rank dies (the last two damage the snapshots first)
            victims = self._kill_all()
            if kind == "wipe_shm" and self.flash_job is not None:
                memory["segments_lost"] = len(memory_faults.drop_host_memory(self.flash_job))
            elif kind == "corrupt_snapshot" and self.flash_job is not None:
                memory["corrupted_step"] = memory_faults.corrupt_newest(self.flash_job, w.logical)
        self.injected_victims |= set(victims)
        if at_step is not None:
            memory["at_step"] = at_step
        self.events.emit("fault_injected", fault=kind, index=index, victims=victims, t_fault=t, **memory)

    # -- chaos ----------------------------------------------------------------------------------------
    def _poll_chaos(self, now: float) -> None:
        """fault=chaos: once the next fault is due and the job is steady, draw it among what the mix can
        handle now and inject it (worker-side kinds through an order and a signal to the victim)."""
        if self.chaos is None or self.chaos.over or not self._steady():
            return
        if self.chaos.t0 is None:
            self.chaos.start(now)
            return
        if self.chaos_wait is not None:
            self._settle_chaos(now)
        if not self.chaos.due(now):
            return
        draw = self.chaos.draw(now, self._chaos_candidates())
        if draw is None:
            self.chaos.settled(now + 1.0)  # nothing the mix can handle now: look again a second later
            return
        index = len(self.faults) + draw.index
        causes = 0 if draw.kind == "bitflip" else 2 if draw.kind == "partition" and self.cfg.fault.duration_s < 0 else 1
        self.chaos_wait = (now, self._recovery_ids + causes, max(w.hb_step for w in self._live()) + 2)
        self.events.emit("chaos_drawn", index=index, fault=draw.kind, victim=draw.victim, reason=(
            f"fault {draw.index + 1} of at most {self.chaos.max_faults}, drawn among what the mix can handle now: "
            f"{ {k: v for k, v in draw.candidates.items() if v} }"))
        if draw.kind == "kill_node":
            self._carry_out(index, draw.kind, next(w for w in self._live() if w.node == draw.victim), draw.victim)
            return
        w = self.workers[self.assigned[draw.victim]]
        if draw.kind in chaos.WORKER_SIDE:
            protocol.set_json(self.store, chaos.ORDER_KEY.format(wid=w.wid),
                              {"kind": draw.kind, "index": index, "duration_s": self.cfg.fault.duration_s})
            self.fleet.signal(w.wid, w.node, chaos.SIGNAL)
        else:
            self._carry_out(index, draw.kind, w, w.node)

    def _settle_chaos(self, now: float) -> None:
        """The last chaos fault settled once the recoveries it causes are over (a bitflip causes none: the
        guard recomputes the step; a partition for good causes two: the retry, then the isolation) and every
        rank has committed two steps past it (a bitflip's recomputed step among them)."""
        since, until_id, until_step = self.chaos_wait
        if min(w.hb_step for w in self._live()) < until_step:
            return
        if self._recovery_ids < until_id and now - since < self.cfg.launcher.recovery_timeout_s:
            return
        if self._recovery_ids < until_id:
            self.events.emit("chaos_fault_unseen", reason=f"no recovery within launcher.recovery_timeout_s="
                             f"{self.cfg.launcher.recovery_timeout_s}s of the last chaos fault; drawing on")
        self.chaos_wait = None
        self.chaos.settled(now)

    def _steady(self) -> bool:
        """No recovery under way and every logical rank computed by a live member that is training, not
        finishing: a fault injected now is one fault, not part of another."""
        if self.active is not None or self.decide_at is not None or self.rejoining:
            return False
        if not self.layouts[self.gen].complete:
            return False
        end = self.cfg.trainer.max_steps - CHAOS_END_MARGIN_STEPS
        return all(w.synced and not w.done and w.hb_phase in ("compute", "reduce", "takeover") and w.hb_step < end
                   for w in self._live() if w.ready)

    def _chaos_candidates(self) -> dict[str, list[int]]:
        """For each chaos kind, the victims (logical ranks; nodes for kill_node) the mix can handle now."""
        members = [w for w in self._live() if w.ready]

        def handled(dead: list[int], lost: tuple = (), hung: bool = False) -> bool:
            return self._judge(dead, list(lost), hung).action != "fail"

        guard_ready = self.cfg.trainer.sdc_factor > 0 and all(
            w.hb_step - w.first_step >= max(self.cfg.trainer.sdc_window, MIN_HISTORY) for w in members)
        retried = handled([])
        out = {}
        for kind in self.chaos.kinds:
            if kind == "kill_node":
                out[kind] = [n for n in sorted({w.node for w in members}) if handled([], [n])]
            elif kind in ("kill_rank", "hang_rank", "partition"):  # a partition is retried, then its rank isolated
                ok = retried or kind != "partition"
                out[kind] = [w.logical for w in members if ok and handled([w.wid], hung=kind == "hang_rank")]
            elif kind == "kill_all":
                out[kind] = [0] if handled([w.wid for w in members]) else []
            else:  # transient, bitflip
                out[kind] = [w.logical for w in members] if (retried if kind == "transient" else guard_ready) else []
        return out

    def _kill_all(self) -> list[int]:
        """SIGKILL every live worker (a stopped one too); returns their logical ranks."""
        live = [w for w in self._live() if not w.dead]
        for w in live:
            self.fleet.signal(w.wid, w.node, signal.SIGKILL)
        self._await_exit(live)
        return sorted(w.logical for w in live)

    def _await_exit(self, workers: list[Worker], timeout_s: float = 5.0) -> None:
        """SIGKILL is asynchronous: a victim may still finish a system call (create a snapshot file) after
        os.kill returns. Wait until the node agents have reported every victim's exit (a lost node's are
        only seen), so that what follows (dropping a node's memory, restarting every rank, deciding on all
        the exits at once) sees their final state and every exit. Only the local fleet has agents; under
        torchrun/SLURM nothing here killed anyone."""
        agents = getattr(self.fleet, "agents", None)
        deadline = time.monotonic() + timeout_s
        while agents and time.monotonic() < deadline and not all(agents[w.node].exit_reported(w.wid) for w in workers):
            time.sleep(0.005)

    # -- decision and action ------------------------------------------------------------------------
    def _decide(self) -> None:
        rec = self.active
        now = time.monotonic()
        if self._isolate_unreachable(rec, now):
            self.decide_at = now + min(self.hb.interval_s, 0.05)
            return
        dead = self._collect_dead()
        lost_nodes = self._silent_nodes(now)
        hung = any(s["kind"] == "hang" for s in rec.symptoms)
        if not dead and not lost_nodes and not self._all_proved_alive(rec.t_detect_mono):
            self.decide_at = now + min(self.hb.interval_s, 0.05)  # a transient needs proof of life from everyone
            return
        self.decide_at = None
        self.silent_reported |= set(lost_nodes)  # handled now: their silence is no new symptom later
        self.nodes_lost |= set(lost_nodes)
        for wid in [w for w in self.spares if self.workers[w].node in lost_nodes]:
            self.spares.remove(wid)
            self.workers[wid].dead = True
            self.events.emit("spare_lost", wid=wid, node=self.workers[wid].node, spares_left=len(self.spares))
        lost_ranks = [w.logical for w in self._live() if w.node in lost_nodes]
        if not dead and not lost_ranks and not hung and lost_nodes:
            self.events.emit("recovery_not_needed", recovery=rec.id, reason=f"node(s) {lost_nodes} held no rank")
            self.recoveries.remove(rec)
            self.active = None
            return
        decision = self._judge(dead, lost_nodes, hung)
        if any(s["kind"] == "unreachable" for s in rec.symptoms):
            decision.fault = "partition"
        rec.fault = rec.fault or decision.fault
        # every rank the fault killed, also those whose exit had not arrived when the decide window closed
        rec.victims = sorted(set(rec.victims) | set(decision.victims) | self.injected_victims)
        self.injected_victims.clear()
        rec.action, rec.reason = decision.action, decision.reason
        rec.t_decide = time.time()
        self.events.emit("recovery_decided", recovery=rec.id, fault=decision.fault, action=decision.action,
                         victims=decision.victims, reason=decision.reason, fault_class=decision.fault_class)
        if decision.action == "fail":
            self._fail(decision.reason)
            return
        for wid in dead:
            self.workers[wid].dead = True
        for node in lost_nodes:
            for w in self._live():
                if w.node == node:
                    w.dead = True
        if decision.action == "restart_rank":
            for lrank in decision.victims:
                home = self.workers[self.takeovers.pop(lrank, self.assigned[lrank])]  # who computed it last
                self.restarts += 1
                self._spawn(lrank, home.node, home.local_rank, role="joiner", first_gen=self.gen + 1)
        elif decision.action == "takeover":
            self._assign_takeovers(decision.victims)
        elif decision.action == "swap_spare":
            self._swap_in_spares(decision.victims)
        elif decision.action == "restart_all":
            self._restart_all(lost_nodes)
        self._after_change()

    def _judge(self, dead: list[int], lost_nodes: list[int], hung: bool) -> Decision:
        """The policy's decision for these dead workers and newly lost nodes, everything else as it is now;
        the ranks a lost worker had taken over (NDB) are lost with it."""
        gone = set(dead) | {w.wid for w in self._live() if w.node in lost_nodes}
        dead_ranks = [self.workers[w].logical for w in dead] + [l for l, wid in self.takeovers.items() if wid in dead]
        lost_ranks = [self.workers[w].logical for w in gone - set(dead)]
        lost_ranks += [l for l, wid in self.takeovers.items() if wid in gone - set(dead)]
        return decide(
            ft=self.ft, cfg=self.cfg, can_restart=self.fleet.can_spawn, dead=sorted(dead_ranks), hung=hung,
            lost_nodes=lost_nodes, lost_ranks=sorted(lost_ranks),
            survivors=[w.logical for w in self._live() if w.synced and w.wid not in gone],
            restarts_left=self._restarts_left(),
            spares=len([s for s in self._ready_spares() if self.workers[s].node not in lost_nodes]),
            full_restarts_left=self.cfg.ft.flash_ckpt.max_restarts - self.full_restarts if self.flash_job else 0,
            nodes_up=len(set(range(self.cfg.parallel.nodes)) - self.nodes_lost - set(lost_nodes)),
            no_snapshots=sorted(self.takeovers),
        )

    def _swap_in_spares(self, failed: list[int]) -> None:
        """DeadPool: warm spares take the failed logical ranks; they get state from a replica as joiners."""
        ready = self._ready_spares()
        for lrank in failed:
            self.takeovers.pop(lrank, None)  # a rank NDB covered until now gets a process of its own
            wid = ready.pop(0)
            self.spares.remove(wid)
            spare = self.workers[wid]
            spare.logical, spare.role, spare.ready = lrank, "joiner", True  # warm: it joins this generation
            self.assigned[lrank] = wid
            self.events.emit("spare_assigned", logical=lrank, wid=wid, node=spare.node, spares_left=len(self.spares))

    def _restart_all(self, lost_nodes: list[int]) -> None:
        """ft=flash_ckpt: kill what is left and start every logical rank again, role restore, from the
        snapshots. Ranks of a lost node start on its partner node (which holds their memory copies),
        or on the first node still up, with local ranks after that node's own."""
        self.full_restarts += 1
        self._kill_all()
        for w in self._live():
            w.dead = True
        self.takeovers.clear()
        self.repairs.clear()
        self.rejoining.clear()
        self.silent_reported |= set(lost_nodes)  # handled here: its silence is no new symptom
        for lrank in range(self.dp):
            node, local = self.topo.restart_place(lrank, self.silent_reported)
            self._spawn(lrank, node, local, role="restore", first_gen=self.gen + 1)

    def _poll_repairs(self, now: float) -> None:
        """NDB with ndb.repair_after_s: restart a taken-over rank once 'repaired'; publish when it is ready."""
        for due, lrank in [r for r in self.repairs if r[0] <= now]:
            self.repairs.remove((due, lrank))
            old = self.workers[self.assigned[lrank]]
            self.rejoining[lrank] = self._spawn(lrank, old.node, old.local_rank, role="joiner",
                                                first_gen=self.gen + 1).wid
            self.events.emit("repair_started", logical=lrank, wid=self.rejoining[lrank], reason=(
                f"ft.ndb.repair_after_s={self.cfg.ft.ndb.repair_after_s} elapsed since the takeover"))
        for lrank, wid in list(self.rejoining.items()):
            if self.workers[wid].ready and self.active is None and self._took_over_a_step(lrank):
                del self.rejoining[lrank]
                self.takeovers.pop(lrank, None)
                self._publish()
                self.events.emit("rejoined", logical=lrank, wid=wid, gen=self.gen)

    def _took_over_a_step(self, lrank: int) -> bool:
        """A repaired rank rejoins only once its takeover committed a step: rejoining before would be churn
        (and with a fast repair it would make whether a takeover ever ran a matter of timing)."""
        members = self.layouts[self.gen].members
        return min((self.workers[wid].hb_step for wid in members), default=0) > self.takeover_from.get(lrank, -1)

    def _assign_takeovers(self, failed: list[int]) -> None:
        """Each failed logical rank goes to a live neighbour (ndb.neighbour), spread over distinct ones."""
        live = {w.logical: w.wid for w in self._live() if not w.dead}
        for lrank in failed:
            busy = set(self.takeovers.values())
            free = [l for l in live if live[l] not in busy] or list(live)
            self.takeovers[lrank] = live[self.topo.ndb_neighbour(lrank, free, self.cfg.ft.ndb.neighbour)]
            self.events.emit("takeover_assigned", logical=lrank, neighbour_wid=self.takeovers[lrank], reason=(
                f"ft.ndb.neighbour={self.cfg.ft.ndb.neighbour} among live ranks not yet taking over"))
            if self.cfg.ft.ndb.repair_after_s >= 0:
                self.repairs.append((time.monotonic() + self.cfg.ft.ndb.repair_after_s, lrank))
                self.takeover_from[lrank] = max((w.hb_step for w in self._live() if not w.dead), default=0)

    def _isolate_unreachable(self, rec: Recovery, now: float) -> bool:
        """A retry whose own generation failed again: members that do not arrive at its rendezvous
        while the others do are alive but cut off from their peers (a partition); they are killed and
        handled as failed ranks. Returns True while the arrivals are still being waited for."""
        last = next((r for r in reversed(self.recoveries) if r is not rec and r.action), None)
        if last is None or last.action != "retry" or last.full_gen is None:
            return False
        if not any(s.get("gen") == last.full_gen for s in rec.symptoms if s["kind"] == "report"):
            return False
        gen = last.full_gen
        rendezvous = PrefixStore(f"pg/{gen}/", self.store)  # where Comm._arrive writes
        missing = [wid for rank, wid in enumerate(self.layouts[gen].members)
                   if not rendezvous.check([f"arrived/{rank}"]) and not self.workers[wid].dead]
        grace = self.hb.interval_s * self.hb.misses  # healthy members arrive in milliseconds
        if missing and now - self.published_at[gen] < grace:
            return True
        for wid in missing:
            self._kill_hung(self.workers[wid], f"did not reach gen {gen}'s rendezvous after a retry while its peers "
                                               "did: alive but cut off from them", kind="unreachable")
        return False

    def _all_proved_alive(self, since: float) -> bool:
        """Every live worker and agent has beaten since the first symptom (a silent one is caught by the
        heartbeat rules within the miss window, and the decision then sees it as dead)."""
        agents_ok = all(beat > since for node, beat in self.fleet.node_beats().items() if node not in self.nodes_lost)
        return agents_ok and all(w.hb_change > since for w in self._live() if w.ready and not w.done)

    def _silent_nodes(self, now: float) -> list[int]:
        limit = self.hb.interval_s * self.hb.misses
        silent = {node for node, beat in self.fleet.node_beats().items() if now - beat > limit}
        silent |= {s["node"] for s in self.active.symptoms if s["kind"] == "node_silent"}
        return sorted(silent - self.nodes_lost)

    def _after_change(self) -> None:
        """Publish survivors-only or complete generations as replacements become ready; a restart of
        every rank publishes only its complete generation (nobody holds state to wait with)."""
        rec = self.active
        if rec.action == "restart_all" and not all(w.ready for w in self._live()):
            return
        layout = self._publish(rec)
        if layout.complete:
            rec.t_ready = rec.t_ready or time.time()
            rec.full_gen = layout.gen
            self.active = None
        elif rec.survivors_gen is None:
            rec.survivors_gen = layout.gen

    def _collect_dead(self) -> list[int]:
        dead = {s["wid"] for s in self.active.symptoms if s["kind"] in ("exit", "hang", "unreachable") and "wid" in s}
        return sorted(w for w in dead if not self.workers[w].dead)

    def _restarts_left(self) -> int:
        owner = restart_owner(self.ft)
        return (self.cfg.ft[owner].max_restarts if owner else 0) - self.restarts

    def _all_done(self) -> bool:
        live = [w for w in self._live() if not w.dead and w.ready]  # a rejoining process still starting is no member
        covered = {w.logical for w in live} | set(self.takeovers)
        return self.active is None and len(covered) == self.dp and all(w.done for w in live)

    # -- the end ------------------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        if self.status != "running":
            return
        self.status, self.error = "failed", reason
        self.store.set("abort", reason)
        self.events.emit("run_failed", error=reason)

    def _echo(self, record: dict) -> None:
        kind = record["kind"]
        if kind in ("run_start", "symptom_reported") or (kind == "generation" and record.get("recovery", -1) == -1):
            return
        details = {k: v for k, v in record.items() if k not in ("t", "step", "rank", "kind")}
        print(f"[runner {time.time() - self.t_start:7.2f}s] {kind}: {json.dumps(details, default=str)}", flush=True)


def _short(details: dict) -> dict:
    return {k: v for k, v in details.items() if k in ("wid", "code", "node", "why", "reason", "gen")}
