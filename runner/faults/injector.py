"""The controller's side of configured faults: carry out a kill, a stop or a node loss a victim announced.

A worker that reaches its fault's trigger writes ``fault/hit/<i>`` and waits; the controller kills or
stops it (or loses its node, or kills every rank), so the fault comes from outside the victim as a real
one would, then releases it. Faults configured for the same step (and moment) are one fault: they are
carried out together once each victim announced (or ``TOGETHER_WITHIN_S`` after the first did), so
that the controller decides on all their exits at once, however many milliseconds apart the victims
reached the step. Faults that damage what a technique keeps in host memory do so here too, through its ``HostMemory``.
Faults the worker carries out itself (transient, slow_rank, bitflip, param_bitflip, slow_link, partition, and
hang_rank with hang=stall) need nothing here.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

from runner.config.validate import all_faults
from runner.control.context import RunContext
from runner.control.records import Worker
from runner.plumbing import protocol
from runner.recovery.actions import HostMemory

WORKER_CARRIED = ("transient", "slow_rank", "bitflip", "param_bitflip", "slow_link", "partition", "chaos")
TOGETHER_WITHIN_S = 2.0  # victims of one step's faults announce within milliseconds; this bounds a missing one


def worker_carried(fault) -> bool:
    """The victim carries it out itself (a hang_rank with hang=stall blocks its own training thread)."""
    return fault.kind in WORKER_CARRIED or (fault.kind == "hang_rank" and fault.hang == "stall")


class FaultInjector:
    """Carries out the configured faults (and chaos's controller-side ones) on the run's processes."""

    def __init__(self, cfg, ctx: RunContext, memory: Optional[HostMemory]) -> None:
        self.ctx, self.memory = ctx, memory
        self.faults = [f for f in all_faults(cfg) if f.kind != "none"]  # indexed as the workers index them
        self.hits: dict[int, dict] = {}  # announced, not yet carried out
        self.done: set[int] = set()  # carried out
        self.first_hit_at: dict[tuple, float] = {}  # a group's first announcement (monotonic)

    def poll(self) -> None:
        """Carry out the faults whose victims announced them since the last round, a step's faults together,
        then release the victims."""
        store = self.ctx.store
        for i, fault in enumerate(self.faults):
            if i in self.hits or i in self.done or worker_carried(fault):
                continue
            if store.check([f"fault/hit/{i}"]):
                self.hits[i] = protocol.get_json(store, f"fault/hit/{i}")
                self.first_hit_at.setdefault(self._group(i), time.monotonic())
        for i in sorted(self.hits):
            group = [j for j in range(len(self.faults)) if self._group(j) == self._group(i) and j not in self.done]
            waited = time.monotonic() - self.first_hit_at[self._group(i)]
            if i in self.done or (not all(j in self.hits for j in group) and waited < TOGETHER_WITHIN_S):
                continue
            for j in (j for j in group if j in self.hits):
                hit = self.hits.pop(j)
                self.done.add(j)
                fault = self.faults[j]
                self.carry_out(j, fault.kind, self.ctx.members.workers[hit["wid"]], fault.node, hit["step"])
                store.set(f"fault/released/{j}", "1")

    def _group(self, i: int) -> tuple:
        """Faults carried out together: the controller-carried ones of one step and moment; any other alone."""
        fault = self.faults[i]
        if fault.step < 0 or worker_carried(fault):
            return ("alone", i)
        return ("step", fault.step, fault.during)

    def carry_out(self, index: int, kind: str, w: Worker, node: int, at_step: Optional[int] = None) -> None:
        """SIGKILL or SIGSTOP worker ``w``, lose ``node``, or kill every rank (and damage snapshot memory).
        ``at_step``: the step boundary the victim announced; a chaos fault lands mid-step, at no known step."""
        fleet, members = self.ctx.fleet, self.ctx.members
        t = time.time()
        memory = {}
        if kind == "kill_rank":
            fleet.signal(w.wid, w.node, signal.SIGKILL)
            victims = [w.logical]
        elif kind == "hang_rank":
            fleet.signal(w.wid, w.node, signal.SIGSTOP)
            victims = [w.logical]
        elif kind == "kill_node":
            wids = fleet.lose_node(node)
            victims = [r for r in (members.workers[v].logical for v in wids) if r >= 0]
            members.await_exit([members.workers[v] for v in wids])
            if self.memory is not None:  # the node's memory went with it (all nodes share this host's /dev/shm)
                memory["segments_lost"] = len(self.memory.drop_node(victims))
        else:  # kill_all, wipe_shm, corrupt_snapshot: every rank dies (the last two damage the snapshots first)
            victims = members.kill_all()
            if kind == "wipe_shm" and self.memory is not None:
                memory["segments_lost"] = len(self.memory.drop_host())
            elif kind == "corrupt_snapshot" and self.memory is not None:
                memory["corrupted_step"] = self.memory.corrupt_newest(w.logical)
        self.ctx.incidents.injected_victims |= set(victims)
        if at_step is not None:
            memory["at_step"] = at_step
        self.ctx.events.emit("fault_injected", fault=kind, index=index, victims=victims, t_fault=t, **memory)
