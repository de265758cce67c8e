"""What each of the runner's actions costs, built from the components in costs.py.

The runner decides (decisions.py); this module prices the decision by its action (restart_rank, swap_spare,
takeover, restart_all, retry, recompute): its five phases, how far training rolls back, and what it uses up
(spares, restart budgets). Measured phases (the calibration file) are per technique, so the technique that carried
the action out is priced with its own. A run the runner fails is requeued by the scheduler as a whole job
(`restart`, also the whole of the `ft=[]` baseline).
"""
import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Optional

from runner.sim.costs import CostModel, Phases
from runner.sim.failures import FaultClass

F = FaultClass
RESTART = "restart"  # the whole-job requeue: the `ft=[]` baseline and what a failed run gets
GUARD = "guard"  # the gradient guard, which recomputes a corrupted step (no technique)


class Rollback(enum.Enum):
    STEP = "step"  # redo the interrupted step only
    SNAPSHOT = "snapshot"  # back to the last in-memory snapshot
    DISK = "disk"  # back to the last disk checkpoint


@dataclass(frozen=True)
class Recovery:
    technique: str  # who carried it out: an `ft` name (runner.recovery.registry), guard, or restart
    action: str  # the runner's action; `fail` when the job was requeued
    phases: Phases
    rollback: Rollback
    spare_ranks: int = 0  # swap_spare: warm spare ranks taken ...
    spare_back_s: float = 0.0  # ... and when they are ready again
    takeover_s: Optional[float] = None  # takeover: a neighbour covers the node this long
    rejoin_s: float = 0.0  # takeover: pause when the node comes back
    restarted_ranks: int = 0  # counted against the in-place restart budget
    restarts_all: bool = False  # every process restarts: takeovers end
    full_restart: bool = False  # counted against the snapshot technique's max_restarts
    requeued: bool = False  # a new run of the job: every budget is full again


class Pricing:
    """Phases of each action at one job size; measured phases from the calibration
    file (per technique name) replace modelled ones."""

    def __init__(self, model: CostModel, overrides: Mapping[str, Mapping[str, float]], gpus: int):
        self.m, self.c, self.gpus = model, model.c, gpus
        self.overrides = overrides
        self.g = model.gpus_per_node
        self._priced: dict[tuple, Recovery] = {}  # a recovery depends only on its arguments

    def phases(self, technique: str, **modelled: float) -> Phases:
        return replace(Phases(**modelled), **self.overrides.get(technique, {}))

    def requeue(self, fault: FaultClass) -> Recovery:
        """The whole-job restart: the `ft=[]` baseline, and what a run the runner fails gets."""
        key = ("fail", RESTART, fault)
        if key not in self._priced:
            self._priced[key] = self._requeue(fault)
        return self._priced[key]

    def price(self, action: str, technique: str, fault: FaultClass) -> Recovery:
        """The runner's `action`, carried out by `technique`, for `fault`."""
        key = (action, technique, fault)
        if key not in self._priced:
            self._priced[key] = self._price(action, technique, fault)
        return self._priced[key]

    def straggler_swap(self, technique: str) -> Recovery:
        """A straggling host handed over to warm spares at a committed step (the runner's planned swap_spare, carried
        out by `technique`): it was found by the straggler window, not by a failure, so nothing is detected or lost;
        the group is rebuilt and the spares take the state from a replica. The released host rejoins the pool after
        a repair's time."""
        key = ("swap_spare", technique, "straggler")
        if key not in self._priced:
            ph = self.phases(technique, rebuild=self.m.group_rebuild(self.gpus), restore=self.m.peer_copy())
            self._priced[key] = Recovery(technique, "swap_spare", ph, Rollback.STEP, spare_ranks=self.g,
                                         spare_back_s=self.m.repair_s)
        return self._priced[key]

    def _requeue(self, fault: FaultClass) -> Recovery:
        """Kill the job, decide (a stack that diagnoses first spends decide_s on it), requeue every
        node, initialise every communicator, load from disk."""
        ph = self.phases(RESTART, detect=self.m.requeue_detect(fault), decide=self.c.decide_s,
                         replace=self.m.requeue(self.gpus),
                         rebuild=self.m.comm_init(self.gpus), restore=self.m.storage_read(self.gpus))
        return Recovery(RESTART, "fail", ph, Rollback.DISK, restarts_all=True, requeued=True)

    def _price(self, action: str, technique: str, fault: FaultClass) -> Recovery:
        lost = fault is F.node_loss
        victims = self.g if lost else 1
        active = dict(detect=self.m.heartbeat_detect(fault), decide=self.c.decide_s)
        rebuild = self.m.group_rebuild(self.gpus)
        if action == "retry":  # healthy processes: rebuild the group, keep the state
            return Recovery(technique, action, self.phases(technique, **active, rebuild=rebuild), Rollback.STEP)
        if action == "restart_rank":
            ph = self.phases(technique, **active, replace=self.c.process_start_s, rebuild=rebuild,
                             restore=self.m.peer_copy())
            return Recovery(technique, action, ph, Rollback.STEP, restarted_ranks=victims)
        if action == "swap_spare":  # the spare is already running: no start, state from a replica
            ph = self.phases(technique, **active, rebuild=rebuild, restore=self.m.peer_copy())
            back = self.m.repair_s if lost else self.c.process_start_s
            return Recovery(technique, action, ph, Rollback.STEP, spare_ranks=victims, spare_back_s=back)
        if action == "takeover":  # a neighbour computes the lost ranks' work too, slower
            away = self.m.repair_s if lost else self.c.process_start_s
            return Recovery(technique, action, self.phases(technique, **active, rebuild=rebuild), Rollback.STEP,
                            takeover_s=away, rejoin_s=rebuild + self.m.peer_copy())
        if action == "restart_all":  # every process restarts from its (or its partner's) memory snapshot
            ph = self.phases(technique, **active, replace=self.c.node_start_s if lost else self.c.process_start_s,
                             rebuild=self.m.comm_init(self.gpus),
                             restore=max(self.m.host_copy(), self.m.peer_copy() if lost else 0.0))
            return Recovery(technique, action, ph, Rollback.SNAPSHOT, restarts_all=True, full_restart=True)
        if action == "recompute":  # the guard rejects the reduced gradient and redoes the step
            return Recovery(GUARD, action, Phases(), Rollback.STEP)
        raise ValueError(f"no cost model for action {action!r}")
