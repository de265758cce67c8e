"""Discrete-event simulation of one long job under one technique mix.

Time advances from event to event (failure, checkpoint, snapshot, a node or
spare coming back, a straggler turning up or being found, end of job). Every
wall-clock second lands in exactly one bucket (useful progress, rework,
downtime, checkpoint stall, degraded-speed loss or straggler loss), so ETTR =
progress / wall time is an accounting identity, not a formula.

Stragglers are a Poisson process of their own (per node, in wall time, with an
RNG stream of their own, so the failures a mix meets do not change): while a
slow host is in the job, the job runs at its pace (step time x
``stragglers.slowdown``). ``window_steps`` slow steps later the runner has found
it, and the policy's straggler row decides: ``report`` leaves it until a restart
of every process brings fresh nodes; ``swap_spare`` (a technique that uses spares,
enough warm spares) hands the host's ranks to spares at a committed step.

Each fault is decided by the runner's own decision function (decisions.py)
with the budgets and spares left at that moment, and priced by pricing.py.
Assumptions (documented in docs/simulator.md): failures strike only while the
job runs (the failure clock stops during a recovery); a failed node is replaced
from the cluster pool unless a spare takes its place (swap_spare) or a neighbour
covers it (takeover); a full restart brings in fresh nodes, which ends any
takeover; a run the runner fails is requeued from the last disk checkpoint with
every budget full again.
"""
import heapq
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from runner.recovery.registry import with_
from runner.sim.costs import CostModel, Phases
from runner.sim.decisions import RunnerPolicy
from runner.sim.failures import FailureModel
from runner.sim.pricing import Pricing, Recovery, Rollback


@dataclass(frozen=True)
class JobPlan:
    """Everything about the job that does not change while it runs."""

    gpus: int
    gpus_per_node: int
    model_parallel_nodes: int
    spares: int  # warm spare ranks (swap_spare)
    end_s: float
    step_s: float
    checkpoint_interval_s: float
    checkpoint_stall_s: float
    snapshot_interval_s: Optional[float]  # None: no in-memory snapshots
    snapshot_stall_s: float
    degraded_speed: float
    repair_s: float
    straggler_rate_per_s: float = 0.0  # straggling hosts turning up, per node and wall second
    straggler_slowdown: float = 1.0  # the job's step time x this while one is in the job
    straggler_detect_s: float = 0.0  # the runner's straggler window, in slow steps

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node


def make_plan(cfg, model: CostModel, failures: FailureModel, gpus: int, mix: Sequence[str]) -> JobPlan:
    """Resolve the checkpoint policy for this size and mix. With a technique in the
    mix that restarts from in-memory snapshots, the disk copy is persisted from a
    snapshot in the background, so only the snapshot's device-to-host copy stalls
    training."""
    save_s = model.storage_write(gpus)
    interval_min = cfg.job.checkpoint_interval_min
    interval_s = (
        model.young_interval_s(save_s, failures.job_mtbf_s(gpus))
        if interval_min is None
        else interval_min * 60.0
    )
    snapshots = bool(with_(mix, "restarts_from_snapshots"))
    return JobPlan(
        gpus=gpus,
        gpus_per_node=cfg.cluster.gpus_per_node,
        model_parallel_nodes=cfg.cluster.model_parallel_nodes,
        spares=cfg.cluster.spares_nodes * cfg.cluster.gpus_per_node,
        end_s=cfg.job.days * 86400.0,
        step_s=cfg.job.step_s,
        checkpoint_interval_s=interval_s,
        checkpoint_stall_s=0.0 if snapshots else save_s,
        snapshot_interval_s=cfg.job.snapshot_interval_min * 60.0 if snapshots else None,
        snapshot_stall_s=cfg.costs.snapshot_block_s,
        degraded_speed=1.0 - cfg.costs.takeover_throughput_loss,
        repair_s=model.repair_s,
        straggler_rate_per_s=cfg.stragglers.per_node_day / 86400.0 if cfg.stragglers.enabled else 0.0,
        straggler_slowdown=cfg.stragglers.slowdown,
        straggler_detect_s=cfg.stragglers.window_steps * cfg.job.step_s * cfg.stragglers.slowdown,
    )


@dataclass(frozen=True)
class Event:
    t_s: float
    cause: str
    fault: str
    technique: str  # who carried it out (Recovery.technique)
    action: str
    phases: Phases
    lost_work_s: float


@dataclass
class RunResult:
    wall_s: float = 0.0
    progress_s: float = 0.0
    rework_s: float = 0.0
    downtime_s: float = 0.0
    checkpoint_s: float = 0.0
    degraded_s: float = 0.0
    straggler_s: float = 0.0  # progress lost to running at a straggler's pace
    stragglers: int = 0  # straggling hosts that turned up
    straggler_swaps: int = 0  # of them, handed over to spares
    events: list[Event] = field(default_factory=list)

    @property
    def ettr(self) -> float:
        return self.progress_s / self.wall_s


@dataclass(frozen=True)
class _Takeover:
    neighbour: Optional[int]
    token: int


class Job:
    """Mutable state of one run: what the runner knows when it decides (budgets,
    spares, takeovers) and the clock with its accounting."""

    def __init__(self, plan: JobPlan, policy: RunnerPolicy, pricing: Pricing, failures: FailureModel,
                 rng: random.Random, straggler_rng: Optional[random.Random] = None):
        self.plan, self.policy, self.pricing, self.failures, self.rng = plan, policy, pricing, failures, rng
        self.straggler_rng = straggler_rng or random.Random(0)
        self.slow_hosts = 0  # straggling hosts in the job now
        self.slow_epoch = 0  # a restart of every process brings fresh nodes: stragglers found later are gone
        self.gpus = plan.gpus
        self.spares = plan.spares
        self.dp_degree = plan.nodes // plan.model_parallel_nodes
        self.restarts = self.full_restarts = 0  # of this run of the job (a requeue starts a new one)
        self.takeovers: dict[int, _Takeover] = {}
        self.pending: list = []  # heap of (time, seq, action, args)
        self.seq = itertools.count()
        self.r = RunResult()
        self.t = 0.0
        self.disk_at = self.snap_at = 0.0  # progress at the last commit
        # progress at the next save; with snapshots the agent persists a snapshot instead (no save event)
        self.next_disk = math.inf if plan.snapshot_interval_s else plan.checkpoint_interval_s
        self.next_snap = plan.snapshot_interval_s or math.inf
        self._next_straggler()

    # covering neighbours (takeover) -------------------------------------------
    def neighbour(self, node: int) -> Optional[int]:
        """A live DP peer (same model position, next replica) that is not already
        covering for someone; None when the node itself is covering."""
        busy = {t.neighbour for t in self.takeovers.values()}
        if self.dp_degree < 2 or node in busy:
            return None
        mp = self.plan.model_parallel_nodes
        replica, position = divmod(node, mp)
        for k in range(1, self.dp_degree):
            peer = ((replica + k) % self.dp_degree) * mp + position
            if peer not in busy and peer not in self.takeovers:
                return peer
        return None

    # time accounting ------------------------------------------------------------
    def _speed(self) -> float:
        return self._covering_speed() * self._straggler_speed()

    def _covering_speed(self) -> float:
        return self.plan.degraded_speed if self.takeovers else 1.0

    def _straggler_speed(self) -> float:
        return 1.0 / self.plan.straggler_slowdown if self.slow_hosts else 1.0

    def _train(self, dt: float) -> None:
        covering, slow = self._covering_speed(), self._straggler_speed()
        self.t += dt
        self.r.progress_s += covering * slow * dt
        self.r.degraded_s += (1.0 - covering) * dt
        self.r.straggler_s += covering * (1.0 - slow) * dt

    def _stall(self, seconds: float) -> float:
        """Advance the clock without progress, never past the end of the job."""
        d = min(seconds, self.plan.end_s - self.t)
        self.t += d
        return d

    def _rollback(self, kind: Rollback) -> float:
        since = {
            Rollback.STEP: math.fmod(self.r.progress_s, self.plan.step_s),
            Rollback.SNAPSHOT: self.r.progress_s - self.snap_at,
            Rollback.DISK: self.r.progress_s - self.disk_at,
        }[kind]
        self.r.progress_s -= since
        self.r.rework_s += since
        p = self.r.progress_s
        self.disk_at, self.snap_at = min(self.disk_at, p), min(self.snap_at, p)
        if self.plan.snapshot_interval_s is None:
            self.next_disk = min(self.next_disk, p + self.plan.checkpoint_interval_s)
        else:
            self.next_snap = min(self.next_snap, p + self.plan.snapshot_interval_s)
        return since

    def _later(self, at: float, action, *args) -> None:
        heapq.heappush(self.pending, (at, next(self.seq), action, args))

    # events --------------------------------------------------------------------
    def _checkpoint(self) -> None:
        self.r.checkpoint_s += self._stall(self.plan.checkpoint_stall_s)
        self.disk_at = self.r.progress_s
        self.next_disk = self.r.progress_s + self.plan.checkpoint_interval_s

    def _more_checkpoints(self, fail_in: float) -> float:
        """Just after a save: the whole save cycles that end before any other event,
        accounted at once (the same seconds as one event each). Returns fail_in."""
        plan = self.plan
        speed = self._speed()
        cycle = plan.checkpoint_interval_s / speed + plan.checkpoint_stall_s
        pending = self.pending[0][0] - self.t if self.pending else math.inf
        n = int(min(plan.end_s - self.t, pending, fail_in) // cycle) - 1  # the last one goes through the loop
        if n <= 0:
            return fail_in
        self._train(n * plan.checkpoint_interval_s / speed)
        self.t += n * plan.checkpoint_stall_s
        self.r.checkpoint_s += n * plan.checkpoint_stall_s
        self.disk_at = self.r.progress_s
        self.next_disk = self.r.progress_s + plan.checkpoint_interval_s
        return fail_in - n * cycle

    def _snapshot(self) -> None:
        """A memory snapshot; the node agent persists it to disk in the background once
        the disk copy is a checkpoint interval old."""
        self.r.checkpoint_s += self._stall(self.plan.snapshot_stall_s)
        self.snap_at = self.r.progress_s
        self.next_snap = self.snap_at + (self.plan.snapshot_interval_s or math.inf)
        if self.snap_at - self.disk_at >= self.plan.checkpoint_interval_s:
            self.disk_at = self.snap_at

    def _respond(self, fault, node: int) -> Recovery:
        """The runner's decision with what is left now, priced; a takeover with no free
        neighbour cannot be carried out, so the job ends and is requeued."""
        policy = self.policy
        decision = policy.decide(
            fault, restarts_left=policy.max_restarts - self.restarts, spare_ranks=self.spares,
            full_restarts_left=policy.max_full_restarts - self.full_restarts, takeovers=bool(self.takeovers))
        if decision.action == "fail" or (decision.action == "takeover" and self.neighbour(node) is None):
            return self.pricing.requeue(fault)
        return self.pricing.price(decision.action, policy.provider(decision.action), fault)

    def _failure(self) -> None:
        failure = self.failures.draw(self.rng)
        node = self._running_node(failure.node_draw)
        rec = self._respond(failure.fault, node)
        neighbour = self.neighbour(node)
        t_fail = self.t
        lost = self._rollback(rec.rollback)
        self.r.downtime_s += self._stall(rec.phases.total)
        self.restarts += rec.restarted_ranks
        self.full_restarts += rec.full_restart
        if rec.requeued:
            self.restarts = self.full_restarts = 0
        if rec.restarts_all:
            self.takeovers.clear()
            self.slow_hosts, self.slow_epoch = 0, self.slow_epoch + 1
        if rec.spare_ranks:
            self.spares -= rec.spare_ranks
            self._later(t_fail + rec.spare_back_s, self._spare_back, rec.spare_ranks)
        if rec.takeover_s is not None:
            token = next(self.seq)
            self.takeovers[node] = _Takeover(neighbour, token)
            self._later(t_fail + rec.takeover_s, self._rejoin, node, token, rec.rejoin_s)
        self.r.events.append(
            Event(t_fail, failure.cause, failure.fault.value, rec.technique, rec.action, rec.phases, lost)
        )

    def _running_node(self, draw: float) -> int:
        """Map a uniform draw onto the nodes that are not out for repair."""
        node = int(draw * (self.plan.nodes - len(self.takeovers)))
        for out in sorted(self.takeovers):
            if out <= node:
                node += 1
        return node

    # stragglers -------------------------------------------------------------------
    def _next_straggler(self) -> None:
        rate = self.plan.straggler_rate_per_s * self.plan.nodes
        if rate > 0:
            self._later(self.t + self.straggler_rng.expovariate(rate), self._straggler_arrives)

    def _straggler_arrives(self) -> None:
        self.slow_hosts += 1
        self.r.stragglers += 1
        self._later(self.t + self.plan.straggler_detect_s, self._straggler_found, self.slow_epoch)
        self._next_straggler()

    def _straggler_found(self, epoch: int) -> None:
        """The runner's straggler window is over: the policy's straggler row acts (``report``: nothing)."""
        if epoch != self.slow_epoch:
            return  # a restart of every process replaced the host already
        action = self.policy.straggler(restarts_left=self.policy.max_restarts - self.restarts,
                                       spare_ranks=self.spares)
        if action != "swap_spare":
            return
        rec = self.pricing.straggler_swap(self.policy.provider("swap_spare"))
        self.r.downtime_s += self._stall(rec.phases.total)
        self.spares -= rec.spare_ranks
        self._later(self.t + rec.spare_back_s, self._spare_back, rec.spare_ranks)
        self.slow_hosts -= 1
        self.r.straggler_swaps += 1

    def _spare_back(self, ranks: int) -> None:
        self.spares += ranks

    def _rejoin(self, node: int, token: int, pause_s: float) -> None:
        taken = self.takeovers.get(node)
        if taken is None or taken.token != token:
            return  # a full restart already replaced the node
        del self.takeovers[node]
        self.r.downtime_s += self._stall(pause_s)

    # main loop -------------------------------------------------------------------
    def run(self) -> RunResult:
        plan = self.plan
        fail_in = self.failures.next_gap_s(self.rng, plan.gpus)  # running seconds
        while self.t < plan.end_s:
            speed = self._speed()
            waits = {
                "end": plan.end_s - self.t,
                "pending": self.pending[0][0] - self.t if self.pending else math.inf,
                "snapshot": (self.next_snap - self.r.progress_s) / speed,  # before a tied save
                "checkpoint": (self.next_disk - self.r.progress_s) / speed,
                "failure": fail_in,
            }
            kind = min(waits, key=lambda k: waits[k])
            dt = max(waits[kind], 0.0)
            self._train(dt)
            fail_in -= dt
            if kind == "end":
                break
            before = self.t
            if kind == "pending":
                _, _, action, args = heapq.heappop(self.pending)
                action(*args)
            elif kind == "checkpoint":
                self._checkpoint()
                fail_in -= self.t - before  # the job is up while it saves
                fail_in = self._more_checkpoints(fail_in)
            elif kind == "snapshot":
                self._snapshot()
                fail_in -= self.t - before
            else:
                self._failure()
                fail_in = self.failures.next_gap_s(self.rng, plan.gpus)
        self.r.wall_s = self.t
        return self.r


def run_point(plan: JobPlan, policy: RunnerPolicy, pricing: Pricing, failures: FailureModel, seed: int,
              runs: int) -> list[RunResult]:
    """`runs` independent histories. The RNG stream depends on (seed, N, run)
    only, so every mix at one size meets the same failures in running time."""
    return [
        Job(plan, policy, pricing, failures, random.Random(f"{seed}:{plan.gpus}:{i}"),
            random.Random(f"{seed}:{plan.gpus}:{i}:stragglers")).run()
        for i in range(runs)
    ]
