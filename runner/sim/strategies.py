"""Recovery strategies as phase models, and the rule that picks one per fault.

Each strategy says which faults it can take (given the job's state: spares
left, a free data-parallel neighbour) and what a recovery costs, built from the
components in costs.py. `choose` walks the `ft` list in order and falls back to
restarting everything from the last disk checkpoint.
"""
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Optional, Protocol

from runner.sim.costs import CostModel, Phases
from runner.sim.errors import ConfigError
from runner.sim.failures import FaultClass

F = FaultClass
RESTART = "restart"  # the baseline; also what `ft=[]` runs


class Rollback(enum.Enum):
    STEP = "step"  # redo the interrupted step only
    SNAPSHOT = "snapshot"  # back to the last in-memory snapshot
    DISK = "disk"  # back to the last disk checkpoint


@dataclass(frozen=True)
class Recovery:
    strategy: str
    phases: Phases
    rollback: Rollback
    takes_spare: bool = False
    takeover_s: Optional[float] = None  # NDB: neighbour covers the node this long
    rejoin_s: float = 0.0  # NDB: pause when the node comes back
    restarts_all: bool = False


class JobView(Protocol):
    gpus: int
    spares: int
    dp_degree: int

    def neighbour(self, node: int) -> Optional[int]: ...


class Strategy:
    name = ""
    keeps_snapshots = False  # takes periodic in-memory snapshots while training

    def __init__(self, model: CostModel, overrides: Mapping[str, float]):
        self.m = model
        self.overrides = dict(overrides)

    def handles(self, fault: FaultClass, node: int, job: JobView) -> bool:
        raise NotImplementedError

    def recover(self, fault: FaultClass, node: int, job: JobView) -> Recovery:
        raise NotImplementedError

    def phases(self, **modelled: float) -> Phases:
        """Modelled phases, with measured values from the calibration file winning."""
        return replace(Phases(**modelled), **self.overrides)


class RestartAll(Strategy):
    """Kill the job, requeue every node, rendezvous from scratch, load from disk."""

    name = RESTART

    def handles(self, fault, node, job):
        return True

    def recover(self, fault, node, job):
        g = job.gpus
        ph = self.phases(
            detect=self.m.passive_detect(fault),
            replace=self.m.reschedule_job(g),
            rebuild=self.m.full_rendezvous(g),
            restore=self.m.storage_io(g),
        )
        return Recovery(self.name, ph, Rollback.DISK, restarts_all=True)


class FlashRecovery(Strategy):
    """Heartbeat detection, restart only the failed node, state from a DP replica."""

    name = "flashrecovery"

    def handles(self, fault, node, job):
        if fault is F.transient:
            return True
        return fault is not F.silent_corruption and job.dp_degree >= 2

    def recover(self, fault, node, job):
        retry = fault is F.transient  # healthy node: re-establish links, keep state
        if retry:
            replace_s = 0.0
        elif fault is F.node_loss:
            replace_s = self.m.start_nodes(1)
        else:
            replace_s = self.m.c.process_start_s
        ph = self.phases(
            detect=self.m.active_detect(fault),
            decide=self.m.c.decide_s,
            replace=replace_s,
            rebuild=self.m.incremental_rendezvous(job.gpus),
            restore=0.0 if retry else self.m.peer_copy(),
        )
        return Recovery(self.name, ph, Rollback.STEP)


class DeadPool(Strategy):
    """Hot-swap a lost node with a warm spare; restart others in place from the
    local host snapshot that is committed every step."""

    name = "deadpool"

    def handles(self, fault, node, job):
        if fault is F.node_loss:
            return job.spares > 0 and job.dp_degree >= 2
        return fault is not F.silent_corruption

    def recover(self, fault, node, job):
        if fault is F.node_loss:  # spare is already running: no start, peer copy
            replace_s, restore_s = 0.0, self.m.peer_copy()
        elif fault is F.transient:
            replace_s, restore_s = 0.0, 0.0
        else:
            replace_s, restore_s = self.m.c.process_start_s, self.m.host_copy()
        ph = self.phases(
            detect=self.m.active_detect(fault),
            decide=self.m.c.decide_s,
            replace=replace_s,
            rebuild=self.m.incremental_rendezvous(job.gpus),
            restore=restore_s,
        )
        return Recovery(self.name, ph, Rollback.STEP, takes_spare=fault is F.node_loss)


class NeighbourDoBoth(Strategy):
    """MeCeFO: a DP neighbour takes over the failed node's work (degraded speed)
    until the node is back; the only pause is shrinking the group logically."""

    name = "ndb"

    def handles(self, fault, node, job):
        covers = fault in (F.node_loss, F.process_crash, F.hang)
        return covers and job.neighbour(node) is not None

    def recover(self, fault, node, job):
        rebuild = self.m.incremental_rendezvous(job.gpus)
        ph = self.phases(
            detect=self.m.active_detect(fault), decide=self.m.c.decide_s, rebuild=rebuild
        )
        away = self.m.repair_s if fault is F.node_loss else self.m.c.process_start_s
        return Recovery(
            self.name, ph, Rollback.STEP,
            takeover_s=away, rejoin_s=rebuild + self.m.peer_copy(),
        )


class FlashCheckpoint(Strategy):
    """DLRover: restart every process, reload from the host-memory snapshot; a
    lost node's shard comes from its partner node's memory backup."""

    name = "flash_ckpt"
    keeps_snapshots = True

    def handles(self, fault, node, job):
        return fault is not F.silent_corruption

    def recover(self, fault, node, job):
        lost = fault is F.node_loss  # only that pod is rescheduled, in parallel
        ph = self.phases(
            detect=self.m.passive_detect(fault),
            replace=self.m.start_nodes(1) if lost else self.m.c.process_start_s,
            rebuild=self.m.full_rendezvous(job.gpus),
            restore=max(self.m.host_copy(), self.m.peer_copy() if lost else 0.0),
        )
        return Recovery(self.name, ph, Rollback.SNAPSHOT, restarts_all=True)


_BY_NAME = {cls.name: cls for cls in (FlashRecovery, DeadPool, NeighbourDoBoth, FlashCheckpoint)}
STRATEGY_NAMES = tuple(_BY_NAME)


def check_mix(names: Sequence[str]) -> None:
    """Reject unknown or repeated names with a message a user can act on."""
    unknown = [n for n in names if n not in STRATEGY_NAMES]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if unknown or repeated:
        problem = (
            f"unknown strategy name(s) {unknown}" if unknown else f"repeated name(s) {repeated}"
        )
        raise ConfigError(
            f"ft: {problem} in {list(names)}. An ft mix is an ordered list of recovery "
            f"strategies; for each fault the first one that can handle it is used. "
            f"Valid names: {', '.join(STRATEGY_NAMES)}. Use 'ft=[]' for the "
            f"restart-all-from-disk baseline, e.g. 'ft=[flashrecovery,deadpool,ndb,flash_ckpt]'."
        )


def build(
    names: Sequence[str], model: CostModel, overrides: Mapping[str, Mapping[str, float]]
) -> list[Strategy]:
    """The mix in `ft` order, with the restart-all fallback appended."""
    check_mix(names)
    mix = [_BY_NAME[n](model, overrides.get(n, {})) for n in names]
    return mix + [RestartAll(model, overrides.get(RESTART, {}))]


def choose(mix: Sequence[Strategy], fault: FaultClass, node: int, job: JobView) -> Strategy:
    """First strategy in the list that can take this fault now (the last one,
    restart-all, takes everything)."""
    return next(s for s in mix if s.handles(fault, node, job))
