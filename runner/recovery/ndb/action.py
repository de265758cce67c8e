"""NDB's controller side: a live neighbour takes over a failed rank's micro-batch; later, a repair.

Each failed logical rank goes to a live neighbour (``Topology.covering_assignment``), spread over distinct
ones; the neighbour computes it as an extra rank of the next generation (``Membership.covered_by``).
With tp*pp > 1 the unit is the model replica: the failed rank's replica leaves whole (its live ranks
are stopped) and every rank of the neighbour replica takes over the rank at its own (pp, tp) coordinate.
With ``ft.ndb.repair_after_s >= 0`` the taken-over ranks are restarted that long after the takeover (the node
is "repaired"): the failed rank, and with tp*pp > 1 every rank of its replica, each a joiner that takes the state
of the DP replica at its own (pp, tp) coordinate. They rejoin together, once all are ready and the takeover
committed a step, and the takeover ends.
"""

from __future__ import annotations

import signal
import time

from runner.recovery.actions import RecoveryAction

Replica = tuple[int, ...]
"""The logical ranks of one taken-over model replica, sorted (a single rank at tp = pp = 1)."""


class Takeover(RecoveryAction):
    """Live neighbours take over the failed ranks' micro-batches; nobody restarts."""

    name = "takeover"
    handles = ("process_crash", "hang", "node_loss_spare_free", "node_loss_no_spare")
    does = "live neighbours take over their micro-batches (NDB); nobody restarts"

    def __init__(self, cfg, topo, run_dir) -> None:
        super().__init__(cfg, topo, run_dir)
        self.repairs: list[tuple[float, Replica]] = []  # (when, a taken-over replica's ranks) to restart and rejoin
        self.started_at: dict[Replica, int] = {}  # taken-over replica -> the committed step its takeover began at
        self.rejoining: dict[Replica, list[int]] = {}  # taken-over replica -> wids of its ranks' restarted processes

    def decide_inputs(self, ctx, lost_nodes: list[int]) -> dict:
        return {"no_snapshots": sorted(ctx.members.covered_by)}  # a neighbour snapshots only its own rank

    def act(self, ctx, decision, lost_nodes: list[int]) -> None:
        members, ndb = ctx.members, self.cfg.ft.ndb
        handed: set[int] = set()
        for lrank in decision.victims:
            if lrank in handed:
                continue  # its replica was handed over with an earlier victim of the same replica
            live = {w.logical: w.wid for w in members.live() if not w.dead}
            busy = set(members.covered_by.values())
            plan = self.topo.covering_assignment(lrank, live, [r for r, wid in live.items() if wid in busy],
                                                 ndb.neighbour)
            self._stop_replica(ctx, [live[r] for r in plan if r in live], lrank)
            for rank, neighbour in plan.items():
                members.covered_by[rank] = live[neighbour]
                handed.add(rank)
                ctx.events.emit("takeover_assigned", logical=rank, neighbour_wid=live[neighbour], reason=(
                    f"ft.ndb.neighbour={ndb.neighbour} among live {'replicas' if len(plan) > 1 else 'ranks'} not yet "
                    "taking over"))
            if ndb.repair_after_s >= 0:  # the whole taken-over replica is repaired: its ranks need each other
                replica = tuple(sorted(plan))
                self.repairs.append((time.monotonic() + ndb.repair_after_s, replica))
                self.started_at[replica] = max((w.hb_step for w in members.live() if not w.dead), default=0)

    @staticmethod
    def _stop_replica(ctx, wids: list[int], failed: int) -> None:
        """The live ranks of a failed rank's model replica leave with it (tp*pp > 1): their tensor-parallel and
        pipeline partner is gone, and the neighbour replica computes their micro-batches. Each is written off
        first, so its exit is no new fault, then stopped."""
        members = ctx.members
        stopped = [members.workers[wid] for wid in wids]
        for w in stopped:
            w.dead = True
            ctx.events.emit("replica_stopped", wid=w.wid, logical=w.logical, failed=failed, reason=(
                f"rank {failed} of its model replica failed, and a replica's collectives need all of its ranks: "
                "the neighbour replica takes over the whole replica's micro-batches (NDB), this process is stopped"))
            members.fleet.signal(w.wid, w.node, signal.SIGKILL)
        members.await_exit(stopped)

    def poll(self, ctx, now: float) -> None:
        """Restart a taken-over replica's ranks, each where it last ran, once 'repaired'; publish when all are
        ready."""
        members = ctx.members
        for due, replica in [r for r in self.repairs if r[0] <= now]:
            self.repairs.remove((due, replica))
            self.rejoining[replica] = []
            for lrank in replica:
                old = members.workers[members.assigned[lrank]]
                wid = members.spawn(lrank, old.node, old.local_rank, role="joiner", first_gen=members.gen + 1).wid
                self.rejoining[replica].append(wid)
                ctx.events.emit("repair_started", logical=lrank, wid=wid, reason=(
                    f"ft.ndb.repair_after_s={self.cfg.ft.ndb.repair_after_s} elapsed since the takeover"))
        for replica, wids in list(self.rejoining.items()):
            ready = all(members.workers[wid].ready for wid in wids)
            if ready and ctx.incidents.active is None and self._took_over_a_step(ctx, replica):
                del self.rejoining[replica]
                for lrank in replica:
                    members.covered_by.pop(lrank, None)
                members.publish()
                for lrank, wid in zip(replica, wids):
                    ctx.events.emit("rejoined", logical=lrank, wid=wid, gen=members.gen)

    def _took_over_a_step(self, ctx, replica: Replica) -> bool:
        """A repaired replica rejoins only once its takeover committed a step: rejoining before would be churn
        (and with a fast repair it would make whether a takeover ever ran a matter of timing)."""
        members = ctx.members
        current = members.layouts[members.gen].members
        return min((members.workers[wid].hb_step for wid in current), default=0) > self.started_at.get(replica, -1)

    def busy(self) -> bool:
        return bool(self.rejoining)

    def on_every_rank_restarted(self) -> None:
        self.repairs.clear()
        self.rejoining.clear()
