"""NDB's controller side: a live neighbour takes over a failed rank's micro-batch; later, a repair.

Each failed logical rank goes to a live neighbour (``Topology.ndb_neighbour``), spread over distinct
ones; the neighbour computes it as an extra rank of the next generation (``Membership.covered_by``).
With ``ft.ndb.repair_after_s >= 0`` the rank is restarted that long after the takeover (the node is
"repaired") and rejoins with a process of its own once its takeover committed a step.
"""

from __future__ import annotations

import time

from runner.recovery.actions import RecoveryAction


class Takeover(RecoveryAction):
    """Live neighbours take over the failed ranks' micro-batches; nobody restarts."""

    name = "takeover"
    does = "live neighbours take over their micro-batches (NDB); nobody restarts"

    def __init__(self, cfg, topo, run_dir) -> None:
        super().__init__(cfg, topo, run_dir)
        self.repairs: list[tuple[float, int]] = []  # (when, logical rank) to restart and rejoin
        self.started_at: dict[int, int] = {}  # logical rank -> the committed step its takeover began at
        self.rejoining: dict[int, int] = {}  # logical rank -> wid of its restarted process

    def decide_inputs(self, ctx, lost_nodes: list[int]) -> dict:
        return {"no_snapshots": sorted(ctx.members.covered_by)}  # a neighbour snapshots only its own rank

    def act(self, ctx, decision, lost_nodes: list[int]) -> None:
        members, ndb = ctx.members, self.cfg.ft.ndb
        live = {w.logical: w.wid for w in members.live() if not w.dead}
        for lrank in decision.victims:
            busy = set(members.covered_by.values())
            free = [rank for rank in live if live[rank] not in busy] or list(live)
            members.covered_by[lrank] = live[self.topo.ndb_neighbour(lrank, free, ndb.neighbour)]
            ctx.events.emit("takeover_assigned", logical=lrank, neighbour_wid=members.covered_by[lrank], reason=(
                f"ft.ndb.neighbour={ndb.neighbour} among live ranks not yet taking over"))
            if ndb.repair_after_s >= 0:
                self.repairs.append((time.monotonic() + ndb.repair_after_s, lrank))
                self.started_at[lrank] = max((w.hb_step for w in members.live() if not w.dead), default=0)

    def poll(self, ctx, now: float) -> None:
        """Restart a taken-over rank once 'repaired'; publish when it is ready."""
        members = ctx.members
        for due, lrank in [r for r in self.repairs if r[0] <= now]:
            self.repairs.remove((due, lrank))
            old = members.workers[members.assigned[lrank]]
            self.rejoining[lrank] = members.spawn(lrank, old.node, old.local_rank, role="joiner",
                                                  first_gen=members.gen + 1).wid
            ctx.events.emit("repair_started", logical=lrank, wid=self.rejoining[lrank], reason=(
                f"ft.ndb.repair_after_s={self.cfg.ft.ndb.repair_after_s} elapsed since the takeover"))
        for lrank, wid in list(self.rejoining.items()):
            if members.workers[wid].ready and ctx.incidents.active is None and self._took_over_a_step(ctx, lrank):
                del self.rejoining[lrank]
                members.covered_by.pop(lrank, None)
                members.publish()
                ctx.events.emit("rejoined", logical=lrank, wid=wid, gen=members.gen)

    def _took_over_a_step(self, ctx, lrank: int) -> bool:
        """A repaired rank rejoins only once its takeover committed a step: rejoining before would be churn
        (and with a fast repair it would make whether a takeover ever ran a matter of timing)."""
        members = ctx.members
        current = members.layouts[members.gen].members
        return min((members.workers[wid].hb_step for wid in current), default=0) > self.started_at.get(lrank, -1)

    def busy(self) -> bool:
        return bool(self.rejoining)

    def on_every_rank_restarted(self) -> None:
        self.repairs.clear()
        self.rejoining.clear()
